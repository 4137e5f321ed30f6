"""The step-time breakdown: every phase present, the phases summing to the step's wall time, the
communication waits those of the counted primitives (none on one process, some at pp = 2), and the
profile window's breakdown file."""
from __future__ import annotations

import json
import time

import torch

from ndtrain.config import validate
from ndtrain.mesh import ParallelDims
from ndtrain.train.loop import Trainer
from ndtrain.train.profiling import PHASES, StepBreakdown
from tests.corpus import source_text
from tests.dist_utils import run_ranks
from tests.utils import tiny_config

V, T, G = 64, 16, 8


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, V, (G, T), generator=g), torch.randint(0, V, (G, T), generator=g)


def _steps(pp: int, world: int, steps: int = 3) -> tuple[list[dict], list[float], bool]:
    cfg = tiny_config({"model.vocab_size": V, "model.dim": 32, "model.n_layers": 4, "data.seq_len": T,
                       "training.global_batch_size": G},
                      parallel={"pp": pp, "dp_shard": -1, "pp_schedule": "1f1b"})
    validate(cfg, world)
    tr = Trainer(cfg, ParallelDims(pp=pp, world_size=world).build_mesh(), torch.device("cpu"))
    bd = StepBreakdown(tr)
    bd.attach()
    wall = []
    for s in range(steps):
        t0 = time.perf_counter()
        tr.step(*_batch(s))
        wall.append(time.perf_counter() - t0)
    bd.detach()
    tr.step(*_batch(steps))  # detached: no more rows, the trainer's own methods again
    clean = "step" not in tr.__dict__ and bd not in tr.pipeline.runtime.observers and len(bd.steps) == steps
    return bd.steps, wall, clean


def _check(rows: list[dict], wall: list[float], comm: bool) -> None:
    for row, w in zip(rows, wall, strict=True):
        assert set(PHASES) <= set(row)
        assert abs(sum(row[k] for k in PHASES) - row["step_s"]) < 1e-9
        # the span inside Trainer.step against the caller's clock: only the call itself between them
        assert row["step_s"] <= w and w - row["step_s"] < 0.005 + 0.05 * w
        for k in ("forward", "backward", "optimizer", "bookkeeping"):
            assert row[k] > 0, (k, row)  # bookkeeping > 0: no wait is counted in two phases
        assert (row["comm_wait"] > 0) if comm else row["comm_wait"] == 0.0


def test_one_process_phases_sum_to_the_step():
    rows, wall, clean = _steps(1, 1)
    _check(rows, wall, comm=False)
    assert clean


def _pp_rank(rank: int, world: int):
    return _steps(2, world)


def test_pp2_phases_sum_to_the_step_and_count_the_waits():
    for rows, wall, clean in run_ranks(_pp_rank, 2):
        _check(rows, wall, comm=True)
        assert clean


def test_profile_window_writes_the_breakdown(tmp_path, capsys):
    from ndtrain.cli.launch import launch
    from ndtrain.config import load_config

    (tmp_path / "corpus.txt").write_text(source_text(60000))
    cfg = load_config("debug", {"data.source": str(tmp_path / "corpus.txt"), "data.tokenizer": "bytes",
                                "data.cache_dir": str(tmp_path / "cache"), "training.steps": "3",
                                "training.eval_every": "0", "checkpoint.every": "0",
                                "logging.profile_steps": "2:3"})
    launch(cfg, tmp_path / "run", 1)
    rep = json.loads((tmp_path / "run" / "profile" / "breakdown_steps_2-3_rank_0.json").read_text())
    assert rep["phases"] == list(PHASES) and len(rep["steps"]) == 2
    for row in rep["steps"]:
        assert abs(sum(row[k] for k in PHASES) - row["step_s"]) < 1e-9 and row["forward"] > 0
    assert abs(rep["mean"]["step_s"] - sum(r["step_s"] for r in rep["steps"]) / 2) < 1e-12
