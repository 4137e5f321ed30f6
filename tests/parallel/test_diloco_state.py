"""DiLoCo's state survives a checkpoint anywhere: under tp / pp, inside an interval, at run level.

1. **Layouts** (slow: 4 gloo ranks, float64, dp_replicate 2 x {tp 2, pp 2}, H = 2, outer lr 0.7,
   Nesterov 0.9, AdamW): a trainer saves a DCP checkpoint after step 5 -- two outer steps done (the
   momentum is live), one inner step into the third interval (the replicas' weights differ, checked)
   -- and keeps training to step 8. A fresh trainer loads the checkpoint: on every rank its local
   anchors, outer momentum buffers and weights equal the saving trainer's at step 5 bitwise, and its
   steps 6-8 losses and grad norms equal the uninterrupted ones bitwise. (Saving each rank's tp slice
   of the anchor under the global name got 16 of 21 anchors wrong on some rank; keeping one
   replica's weights made step 6 differ by ~4e-3.)
2. **Run level** (2 ranks, dp_replicate 2, the ``debug`` preset in float64, H = 2): a run with
   ``training.stop_at_step=3`` (inside the second interval) then resumed to step 8 logs losses and
   grad norms bitwise equal to an uninterrupted 8-step run.
3. **Skipped steps** (the same 2 ranks): a NaN on rank 1 at step 2 (the end of the first interval)
   skips the step: weights, anchor and the inner-step count are unchanged and no outer step runs;
   the outer step follows the next applied step (3), and outer_steps is 1 after step 3.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.corpus import source_text
from tests.dist_utils import run_ranks
from tests.parallel.test_diloco import _trainer
from tests.parallel.test_zero import global_batch


def _local_batch(tr, step: int):
    dp = tr.mesh.group("dp")  # replica-major: replica r reads rows [4 r, 4 r + 4)
    n = 8 // dp.size
    x, y = global_batch(step, 8)
    return x[dp.rank * n:(dp.rank + 1) * n], y[dp.rank * n:(dp.rank + 1) * n]


def _outer(tr) -> dict:
    o = tr.outer
    mom = [o.outer.state.get(a, {}).get("momentum_buffer") for a in o.anchor]
    return {"anchor": [a.clone() for a in o.anchor], "momentum": [None if m is None else m.clone() for m in mom],
            "weights": [p.detach().clone() for p in o.params], "counts": (o.outer_steps, o.inner_steps)}


def _replicas_differ(tr) -> bool:
    from ndtrain.parallel import comm

    s = sum(float(p.detach().double().sum()) for p in tr.outer.params)
    rep = tr.mesh.group("dp_replicate")
    return comm.all_reduce_scalar(s * s, rep) != comm.all_reduce_scalar(s, rep) ** 2 / rep.size


def _layout_resume(rank: int, world: int, tmp: str) -> dict:
    from ndtrain.checkpoint import dcp as ckpt

    out = {}
    for axis in ("tp", "pp"):
        layout = {"dp_replicate": 2, "dp_shard": 1, axis: 2}
        root = f"{tmp}/{axis}"
        cont = _trainer(world, 2, 0.7, 0.9, **layout)
        rows = []
        for s in range(8):
            res = cont.step(*_local_batch(cont, s))
            rows.append((res["loss"], res["grad_norm"]))
            if s == 4:  # after step 5
                saved, differ = _outer(cont), _replicas_differ(cont)
                ckpt.save_checkpoint(root, 5, cont.tensor_state(), {"step": 5, "scheduler": cont.scheduler.state_dict()},
                                     keep_last=1)
        fresh = _trainer(world, 2, 0.7, 0.9, **layout)
        state = fresh.tensor_state()
        meta = ckpt.load_checkpoint(ckpt.latest_checkpoint(root), state)
        fresh.load_tensor_state(state)
        fresh.scheduler.load_state_dict(meta["scheduler"])
        fresh.step_count = meta["step"]
        got = _outer(fresh)
        equal = {k: (got[k] == saved[k] if k == "counts" else all(torch.equal(a, b) for a, b in zip(got[k], saved[k])))
                 for k in saved}  # the momentum exists: two outer steps ran
        resumed = []
        for s in range(5, 8):
            res = fresh.step(*_local_batch(fresh, s))
            resumed.append((res["loss"], res["grad_norm"]))
        out[axis] = {"equal": equal, "counts": saved["counts"], "differ": differ, "n": len(saved["anchor"]),
                     "resumed": resumed, "want": rows[5:]}
    return out


@pytest.mark.slow
def test_diloco_state_resumes_bitwise_under_tp_and_pp_inside_an_interval(tmp_path):
    """4 ranks, ~100 s on the shared 2-core CPU (``-m slow``)."""
    res = run_ranks(_layout_resume, 4, str(tmp_path), timeout_s=300)
    for rank, r in enumerate(res):
        for axis, a in r.items():
            assert a["counts"] == (2, 1) and a["differ"] and a["n"] > 0, (rank, axis, a)
            assert all(a["equal"].values()), (rank, axis, a["equal"])
            assert a["resumed"] == a["want"], (rank, axis, a["resumed"], a["want"])


def _cfg(tmp: Path, world: int, **over):
    from ndtrain.config import load_config

    base = {"data.source": str(tmp / "corpus.txt"), "data.tokenizer": "bytes", "data.cache_dir": str(tmp / "cache"),
            "training.steps": 8, "training.dtype": "float64", "training.eval_every": 0, "training.sample_tokens": 0,
            "training.local_sgd_steps": 2, "parallel.dp_replicate": 2, "parallel.dp_shard": 1,
            "checkpoint.every": 2, "logging.log_every": 1, "logging.plot": False}
    return load_config("debug", {**base, **over}, world_size=world)


def _run_level(rank: int, world: int, tmp: str) -> dict:
    import torch.distributed as dist

    from ndtrain.data import prepare_data
    from ndtrain.train import loop
    from ndtrain.train.metrics import read_metrics

    tmp = Path(tmp)
    cfg = _cfg(tmp, world)
    box = [str(prepare_data(cfg.data, cfg.model.vocab_size)) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    data = Path(box[0])
    loop.run(cfg, tmp / "straight", data)
    loop.run(_cfg(tmp, world, **{"training.stop_at_step": 3}), tmp / "paused", data)
    loop.run(cfg, tmp / "paused", data)  # resumes from the step-3 checkpoint
    if rank != 0:
        return {}
    rows = {name: [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(tmp / name) if "loss" in r]
            for name in ("straight", "paused")}
    return rows


def _skip_counts(rank: int, world: int) -> dict:
    tr = _trainer(world, 2, 0.7, 0.9, dp_replicate=2, dp_shard=1)
    if rank == 1:
        tr.nan_steps = frozenset({2})
    rows = []
    for s in range(3):
        before = _outer(tr)
        res = tr.step(*_local_batch(tr, s))
        after = _outer(tr)
        same = all(torch.equal(a, b) for k in ("anchor", "weights") for a, b in zip(before[k], after[k]))
        rows.append((res["bad_step"], res["outer_step"], same, after["counts"]))
    return {"rows": rows}


def _all(rank: int, world: int, tmp: str) -> dict:
    return {"run": _run_level(rank, world, tmp), "skip": _skip_counts(rank, world)}


def test_diloco_stop_inside_an_interval_resumes_bitwise_and_skips_change_nothing(tmp_path):
    (tmp_path / "corpus.txt").write_text(source_text(40000))
    res = run_ranks(_all, 2, str(tmp_path), timeout_s=300)
    run = res[0]["run"]
    assert [r[0] for r in run["straight"]] == list(range(1, 9)), run
    assert run["paused"] == run["straight"], run  # steps 1-3, then 4-8 after the resume
    assert all(math.isfinite(r[1]) for r in run["straight"])
    for r in res:
        rows = r["skip"]["rows"]
        assert rows[0] == (False, False, False, (0, 1)), rows  # step 1: trained, no outer step
        assert rows[1] == (True, False, True, (0, 1)), rows  # step 2 skipped: nothing moved
        assert rows[2][:2] == (False, True) and rows[2][3] == (1, 0), rows  # step 3: the outer step
