"""Elastic continuation on fewer ranks (``ndtrain train --elastic``) and the goodput line.

The chaos test: 4 gloo ranks (float64, DDP, global batch 12), checkpoints every 3 steps; ndtrain's
chaos driver marks a random rank lost for good and ``kill -9``s it after the first checkpoint. The
launcher must continue on the 3 survivors in the layout the planner picks, keep the global batch,
say so on the console and in ``events.jsonl``, and finish. Reference for the steps after the change:
a fresh ``checkpoint.load_from`` resume of the same checkpoint in the same new layout, started by
hand -- float64 on one thread per rank is deterministic, so the losses must be equal bitwise.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ndtrain.config import ConfigError, load_config
from ndtrain.events import read_events
from ndtrain.fault.chaos import chaos_run
from ndtrain.fault.elastic import Elastic, choose_layout, mark_lost
from ndtrain.train.metrics import read_metrics
from tests.corpus import source_text

ROOT = Path(__file__).resolve().parents[2]


def _args(tmp: Path) -> list[str]:
    corpus = tmp / "corpus.txt"
    if not corpus.exists():
        corpus.write_text(source_text(60000))
    over = {"data.source": corpus, "data.tokenizer": "bytes", "data.cache_dir": tmp / "cache",
            "model.vocab_size": 257, "training.steps": 12, "training.dtype": "float64",
            "training.global_batch_size": 12, "training.micro_batch_size": 1, "logging.log_every": 1,
            "training.eval_every": 0, "checkpoint.every": 3, "checkpoint.keep_last": 10,
            "training.sample_tokens": 4, "logging.plot": False}
    return [f"--{k}={v}" for k, v in over.items()]


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


@pytest.mark.slow
def test_a_rank_lost_for_good_continues_on_three_like_a_fresh_resume(tmp_path):
    args = _args(tmp_path)

    def cmd(run_dir: Path, nproc: int, *extra: str) -> list[str]:
        return [sys.executable, "-m", "ndtrain.cli", "train", "--config", "debug", "--nproc", str(nproc),
                f"--run-dir={run_dir}", *args, *extra]

    env = dict(os.environ, OMP_NUM_THREADS="1")
    rd = tmp_path / "elastic"
    res = chaos_run(cmd(rd, 4, "--max-restarts", "3", "--elastic"), rd, 4, kills=1, seed=3, save_kills=0,
                    max_delay_s=0.2, timeout_s=500, env=env, lose=1)
    assert res.returncode == 0, res.output[-4000:]
    assert [k["kind"] for k in res.kills] == ["lose"]
    [ev] = read_events(rd, "elastic")
    lost = res.kills[0]["rank"]
    assert (ev["from_world"], ev["to_world"], ev["lost_ranks"]) == (4, 3, [lost])
    assert ev["reason"] == f"marked lost (elastic/lost_rank{lost})"
    assert ev["from_layout"]["dp_shard"] == 4 and ev["global_batch"] == 12
    assert ev["local_batch"] == [3, 4] and ev["overrides"]["parallel.dp_shard"] == 3
    assert f"ndtrain: elastic: rank(s) [{lost}] lost" in res.output and "global batch 12 kept" in res.output
    step = ev["step"]
    assert step >= 3 and step % 3 == 0
    # the reference: a fresh resume of that checkpoint in the layout the launcher chose
    fresh = tmp_path / "fresh"
    over = [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in ev["overrides"].items()]
    ref = subprocess.run(cmd(fresh, 3, *over, f"--checkpoint.load_from={rd / 'checkpoints' / f'step_{step:08d}'}"),
                         check=False, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    got, want = _losses(rd), _losses(fresh)
    assert sorted(got) == list(range(1, 13)) and sorted(want) == list(range(step + 1, 13))
    assert all(got[s] == want[s] for s in want), [(s, got[s], want[s]) for s in want]
    # goodput: one final line over both attempts; the lost rank's restart costs start-up time
    [final] = [e for e in read_events(rd, "goodput") if e["final"]]
    assert final["attempts"] == 2 and final["n_steps"] + final["n_recomputed"] == 12
    assert final["restarts"] > 0 and 0 < final["goodput"] < 1
    line = next(x for x in res.output.splitlines() if x.startswith("goodput "))
    assert line.startswith(f"goodput {100 * final['goodput']:.1f}%: steps ")
    print(next(x for x in res.output.splitlines() if x.startswith("ndtrain: elastic:")), line, sep="\n")


def test_lost_rank_detection_markers_and_repeated_failures(tmp_path):
    cfg = load_config("debug", {"training.global_batch_size": 12, "training.micro_batch_size": 1}, world_size=4)
    started = []
    el = Elastic(cfg, 4, tmp_path, lambda c, n: started.append(n), fail_limit=2, say=lambda s: None)
    assert el.after_failure(2, 3, 4) is None  # one failure of rank 2: a restart of the same world
    assert el.after_failure(1, 3, 4) is None  # another rank: not twice in a row
    ev = el.after_failure(1, 6, 7)  # rank 1 twice in a row: lost
    assert (ev["reason"], ev["from_world"], ev["to_world"]) == ("rank 1 failed 2 times in a row", 4, 3)
    assert el.world == 3 and el.cfg.parallel.dp_shard == 3 and el.cfg.training.global_batch_size == 12
    mark_lost(tmp_path, 0)
    ev = el.after_failure(None, 9, 9)  # a marker wins at once, whoever was blamed
    assert ev["reason"] == "marked lost (elastic/lost_rank0)" and el.world == 2
    assert not list((tmp_path / "elastic").iterdir())  # markers are consumed
    el.start()
    assert started == [2]
    mark_lost(tmp_path, 0)
    mark_lost(tmp_path, 1)
    with pytest.raises(ConfigError, match=r"every rank is lost \(marked lost"):
        el.after_failure(0, 9, 9)


def test_choose_layout_keeps_the_batch_and_validates_or_says_why():
    cfg = load_config("debug", {"training.global_batch_size": 8, "parallel.tp": 2}, world_size=4)
    new, changed = choose_layout(cfg, 2)
    from ndtrain.config import validate
    validate(new, 2)
    assert new.training.global_batch_size == 8 and new.model == cfg.model
    assert all(k.startswith(("parallel.", "training.micro_batch_size", "training.activation_checkpoint"))
               for k in changed)
    with pytest.raises(ConfigError, match=r"no layout of 3 rank\(s\) validates and fits for global batch 8"):
        choose_layout(cfg, 3)  # 8 sequences over 3 ranks: no dp; tp3 / pp3 do not split this model


def test_torchrun_world_change_replans_from_the_checkpoint_layout(tmp_path):
    import json

    from ndtrain.fault.elastic import replan_for_world

    cfg = load_config("debug", {"training.global_batch_size": 12, "training.micro_batch_size": 1}, world_size=4)
    assert replan_for_world(cfg, 4, tmp_path, 0) is cfg  # no checkpoint: nothing to compare with
    ck = tmp_path / "checkpoints" / "step_00000006"
    ck.mkdir(parents=True)
    layout = {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "cp": 1, "tp": 1}
    (ck / "meta.json").write_text(json.dumps({"step": 6, "layout": layout}))
    assert replan_for_world(cfg, 4, tmp_path, 0) is cfg  # the same world: the config as given
    said = []
    new = replan_for_world(cfg, 2, tmp_path, 0, say=said.append)
    assert new.parallel.dp_shard == 2 and new.training.global_batch_size == 12
    [ev] = read_events(tmp_path, "elastic")
    assert (ev["from_world"], ev["to_world"], ev["step"], ev["launcher"]) == (4, 2, 6, "torchrun")
    to = " x ".join(f"{k}{v}" for k, v in ev["to_layout"].items() if v > 1)
    assert said == [(f"ndtrain: elastic: torchrun started 2 workers; the checkpoint was written by 4; layout "
                     f"dp_shard4 -> {to}, global batch 12 kept")]
