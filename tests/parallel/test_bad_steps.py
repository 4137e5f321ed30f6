"""Bad steps, rollback and the straggler report (``ndtrain.fault.bad_steps`` / ``straggler``).

One group of 2 gloo ranks runs every multi-process check:

1. Trainer level (DDP and ZeRO-3, float64): rank 1 alone poisons its loss and a gradient with NaN at
   step 3 (``Trainer.nan_steps``, after the gradient sync, so rank 0's own values stay finite). On
   *both* ranks step 3 reports ``bad_step`` with ``bad_ranks == [1]`` (ZeRO-3: [0, 1]: its global norm
   sums the NaN shard on every rank) and leaves the weights, the
   AdamW state and the LR schedule position bitwise unchanged (``torch.equal``: a skipped step
   touches nothing); steps 2 and 4 do change the weights.
2. Run level (``ndtrain.train.loop.run``, debug preset, float32): rank 1 poisons steps 6 and 7 with
   ``max_bad_steps=2`` and checkpoints every 4 steps: step 7 rolls back to the step-4 checkpoint,
   the sampler keeps its position (stream items 32..56 of G=8 skipped); events ``bad_step`` x2 and
   ``rollback``. Then rank 1 reports a 100x loss at step 9 (``Trainer.spike_steps``; the global loss
   spikes on every rank) with ``spike_zscore=10`` over a 4-step window, refilled by the redone
   steps 5-8: a ``loss_spike`` event and a rollback to the step-8 checkpoint (stream 88..96
   skipped). The run completes its 10 steps. Rank 1 also sleeps 60 ms in every data
   load, so the straggler report names it (``slowest_rank`` 1, ratio > 1.1, a ``straggler`` event).

Single-process: the spike detector's z-score against a hand computation.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

from ndtrain.fault.bad_steps import BadStepGuard
from tests.corpus import source_text
from tests.dist_utils import run_ranks
from tests.parallel.test_zero import global_batch, tiny_cfg


def _snapshot(tr):
    from torch.distributed.tensor import DTensor

    sd = tr.dp.model_state_dict()
    w = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in sd.items()}
    opt = {i: {k: v.clone() for k, v in st.items()} for i, st in enumerate(tr.optimizer.state.values())}
    return w, opt, tr.scheduler.last_epoch


def _same(a, b) -> bool:
    (wa, oa, sa), (wb, ob, sb) = a, b
    return (sa == sb and all(torch.equal(wa[k], wb[k]) for k in wa)
            and all(torch.equal(oa[i][k], ob[i][k]) for i in oa for k in oa[i]))


def _trainer_checks(rank: int, world: int) -> dict:
    from ndtrain.mesh import ParallelDims
    from ndtrain.train.trainer import Trainer

    out = {}
    for stage in (0, 3):
        cfg = tiny_cfg(8, 2, zero_stage=stage)
        tr = Trainer(cfg, ParallelDims.from_config(cfg.parallel, world).build_mesh(), torch.device("cpu"))
        if rank == 1:
            tr.nan_steps = frozenset({3})
        rows = []
        for s in range(4):
            x, y = global_batch(s, 8)
            before = _snapshot(tr)
            res = tr.step(x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4])
            rows.append((res["bad_step"], res.get("bad_ranks"), _same(before, _snapshot(tr)),
                         math.isfinite(res["loss"])))
        out[stage] = rows
    return out


def _run_checks(rank: int, world: int, tmp: str) -> dict:
    from ndtrain.config import load_config
    from ndtrain.data import prepare_data
    from ndtrain.events import read_events
    from ndtrain.train import loop as train
    from ndtrain.train.metrics import read_metrics
    from ndtrain.train.trainer import Trainer

    tmp = Path(tmp)
    cfg = load_config("debug", {"data.source": str(tmp / "corpus.txt"), "data.tokenizer": "bytes",
                                "data.cache_dir": str(tmp / "cache"), "training.steps": 10,
                                "training.eval_every": 0, "training.max_bad_steps": 2,
                                "training.spike_zscore": 10.0, "training.spike_window": 4,
                                "checkpoint.every": 4, "logging.log_every": 5, "training.sample_tokens": 4},
                      world_size=world)
    data = prepare_data(cfg.data, cfg.model.vocab_size) if rank == 0 else None
    import torch.distributed as dist

    box = [str(data)]
    dist.broadcast_object_list(box, src=0)
    if rank == 1:
        Trainer.nan_steps = frozenset({6, 7})  # this process only
        Trainer.spike_steps = frozenset({9})
        real_local = train._Run.local

        def slow_local(self, indices, split, real_local=real_local):
            if split == "train":
                time.sleep(0.06)
            return real_local(self, indices, split)

        train._Run.local = slow_local
    train.run(cfg, tmp / "run", Path(box[0]))
    if rank != 0:
        return {}
    rows = read_metrics(tmp / "run")
    return {"events": read_events(tmp / "run"), "steps": [r["step"] for r in rows if "loss" in r],
            "straggler": [(r["slowest_rank"], r["slowest_vs_median"]) for r in rows if "slowest_rank" in r]}


def _all(rank: int, world: int, tmp: str) -> dict:
    return {"trainer": _trainer_checks(rank, world), "run": _run_checks(rank, world, tmp)}


def test_bad_steps_skip_rollback_and_straggler(tmp_path):
    (tmp_path / "corpus.txt").write_text(source_text(60000))
    res = run_ranks(_all, 2, str(tmp_path), timeout_s=240)
    for rank in (0, 1):
        for stage in (0, 3):
            rows = res[rank]["trainer"][stage]
            # DDP: only rank 1's own norm is NaN; ZeRO-3 sums the norm over shards, so both are
            flagged = [1] if stage == 0 else [0, 1]
            assert rows[2][:3] == (True, flagged, True), (rank, stage, rows)  # skipped, named, unchanged
            for s in (0, 1, 3):
                assert rows[s][:3] == (False, None, False), (rank, stage, s, rows)  # normal steps update
            assert rows[3][3]  # the step after the skip is finite again
    run = res[0]["run"]
    kinds = [e["kind"] for e in run["events"]]
    assert kinds.count("bad_step") == 2 and kinds.count("rollback") == 2, kinds
    bad = [e for e in run["events"] if e["kind"] == "bad_step"]
    assert [e["step"] for e in bad] == [6, 7] and all(e["ranks"] == [1] for e in bad)
    rb, rb2 = [e for e in run["events"] if e["kind"] == "rollback"]
    assert (rb["step"], rb["to_step"], rb["reason"]) == (7, 4, "bad_steps")
    assert rb["skipped_stream"] == [4 * 8, 7 * 8]  # checkpoint's position .. past the bad batch
    spike = next(e for e in run["events"] if e["kind"] == "loss_spike")
    # the global loss is (100 a + b) / n with a ~ b: about 50x the window's mean
    assert spike["step"] == 9 and spike["zscore"] > 10 and spike["loss"] > 30 * spike["mean"]
    assert (rb2["step"], rb2["to_step"], rb2["reason"]) == (9, 8, "loss_spike")
    assert rb2["skipped_stream"] == [11 * 8, 12 * 8]  # the step-8 checkpoint read 11 batches
    assert run["steps"] == [5, 10]  # the run completed; step 5 was redone after the rollback
    assert run["straggler"] and all(s == 1 and ratio > 1.1 for s, ratio in run["straggler"])
    assert "straggler" in kinds


def test_spike_zscore_against_hand_computation():
    g = BadStepGuard(max_bad_steps=3, spike_zscore=3.0, spike_window=4)
    for loss in (2.0, 2.2, 1.8, 2.0):
        assert g.observe(False, loss) == (None, {})
    mean, std = 2.0, math.sqrt((0 + 0.04 + 0.04 + 0) / 3)  # sample std of the window
    z, m, s = g.zscore(2.5)
    assert m == pytest.approx(mean, rel=1e-12) and s == pytest.approx(std, rel=1e-12)
    assert z == pytest.approx((2.5 - mean) / std, rel=1e-12)
    assert g.observe(False, 2.3)[0] is None  # z = 1.85: kept, the window slides
    decision, details = g.observe(False, 4.0)
    assert decision == "loss_spike" and details["zscore"] > 3.0
    assert [g.observe(True, float("nan"))[0] for _ in range(3)] == [None, None, "bad_steps"]
