"""DiLoCo over dp_replicate (``ndtrain.parallel.dp.diloco``): twins and checkpoint round trip.

One group of 2 gloo ranks (dp_replicate 2), float64, the tiny model of ``test_zero`` widened to
4 heads / 2 kv heads / ffn 64 (so tp 2 fits the slow composition test at the end):

1. **Twin of synchronous DP**: H = 1, outer SGD lr 1, momentum 0, inner SGD (lr 0.05, no clipping,
   set on both trainers: the equality needs an inner step linear in the gradient, see the module
   docstring) against plain DDP over 2 ranks with the same inner SGD, 3 steps of the same global
   batches. Each replica's gradient is its half-batch mean, the mean of the two is the DDP gradient,
   so the weights agree to float64 rounding (1e-12 relative: a few reassociated additions).
2. **Twin of a hand-written DiLoCo**: H = 2, outer lr 0.7, Nesterov momentum 0.9, inner AdamW with
   clipping, 6 steps (3 outer steps), against two single-process trainers (one per replica, same
   half batches) and the outer Nesterov step written out (buf = mu buf + g; anchor -= lr (g + mu
   buf), PyTorch's SGD convention). 1e-10: the same operations in a different process.
3. **Checkpoint round trip**: after 4 steps a DCP checkpoint (anchor, outer momentum, each replica's
   weights and AdamW state) is loaded into a fresh trainer; 2 more steps on both are bitwise equal
   (inside an interval and under tp / pp: ``test_diloco_state.py``).
4. Bytes: over the 6 steps of (2) the dp_replicate axis carries 3 all-reduces of every parameter
   (2 (R-1)/R * Psi * 8 bytes each) plus one 8-byte loss all-reduce per step.
"""
from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_ranks
from tests.parallel.test_zero import global_batch, tiny_cfg


def _sgd(tr, lr: float = 0.05) -> None:
    tr.optimizer = torch.optim.SGD([p for p in tr.model.parameters()], lr=lr)
    tr.scheduler = torch.optim.lr_scheduler.LambdaLR(tr.optimizer, lambda s: 1.0)


def _weights(tr) -> dict:
    return {k: v.detach().clone() for k, v in tr.model.state_dict().items()}


def _trainer(world: int, steps_h: int, outer_lr: float, mom: float, **parallel):
    from ndtrain.mesh import ParallelDims
    from ndtrain.train.trainer import Trainer

    cfg = tiny_cfg(8, 4, **parallel)
    cfg.model.dim, cfg.model.n_heads, cfg.model.n_kv_heads, cfg.model.ffn_hidden = 32, 4, 2, 64  # tp 2 fits
    cfg.training.local_sgd_steps, cfg.training.outer_lr, cfg.training.outer_momentum = steps_h, outer_lr, mom
    return Trainer(cfg, ParallelDims.from_config(cfg.parallel, world).build_mesh(), torch.device("cpu"))


def _twin_ddp(rank: int, world: int) -> float:
    dil = _trainer(world, 1, 1.0, 0.0, dp_replicate=2, dp_shard=1)
    ddp = _trainer(world, 0, 1.0, 0.0, dp_shard=2)
    for tr in (dil, ddp):
        tr.cfg.training.grad_clip = 0.0
        _sgd(tr)
    for s in range(3):
        x, y = global_batch(s, 8)
        for tr in (dil, ddp):
            tr.step(x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4])
    a, b = _weights(dil), _weights(ddp)
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in a)


def _twin_reference(rank: int, world: int, tmp: str) -> dict:
    from ndtrain.checkpoint import dcp as ckpt

    dil = _trainer(world, 2, 0.7, 0.9, dp_replicate=2, dp_shard=1)
    reps = [_trainer(1, 0, 0.7, 0.9, dp_shard=1) for _ in range(2)]  # one process, world-1 meshes
    anchor = _weights(reps[0])
    buf = {k: torch.zeros_like(v) for k, v in anchor.items()}
    dil.mesh.reset_stats()
    for s in range(6):
        x, y = global_batch(s, 8)
        dil.step(x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4])
        for r, tr in enumerate(reps):
            tr.step(x[r * 4:(r + 1) * 4], y[r * 4:(r + 1) * 4])
        if (s + 1) % 2 == 0:  # the outer Nesterov step, by hand
            ws = [_weights(tr) for tr in reps]
            for k in anchor:
                g = anchor[k] - (ws[0][k] + ws[1][k]) / 2
                buf[k] = g if s == 1 else 0.9 * buf[k] + g
                anchor[k] = anchor[k] - 0.7 * (g + 0.9 * buf[k])
            for tr in reps:
                tr.model.load_state_dict(anchor)
        if s == 3:
            meta = {"step": 4, "scheduler": dil.scheduler.state_dict()}
            ckpt.save_checkpoint(tmp, 4, dil.tensor_state(), meta, keep_last=1)
    bytes_rep = dil.mesh.reset_stats().get("dp_replicate", 0.0)
    got = _weights(dil)
    err = max(((got[k] - anchor[k]).abs().max() / anchor[k].abs().max()).item() for k in got)
    fresh = _trainer(world, 2, 0.7, 0.9, dp_replicate=2, dp_shard=1)
    state = fresh.tensor_state()
    meta = ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp), state)
    fresh.load_tensor_state(state)
    fresh.scheduler.load_state_dict(meta["scheduler"])
    fresh.step_count = meta["step"]
    cont = _trainer(world, 2, 0.7, 0.9, dp_replicate=2, dp_shard=1)  # the uninterrupted twin of fresh
    for s in range(6):
        x, y = global_batch(s, 8)
        if s >= 4:
            fresh.step(x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4])
        cont.step(x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4])
    a, b = _weights(fresh), _weights(cont)
    psi = sum(p.numel() for p in dil.model.parameters())
    return {"err": err, "resume_equal": all(torch.equal(a[k], b[k]) for k in a),
            "outer_steps": dil.outer.outer_steps, "bytes": bytes_rep, "psi": psi}


def _all(rank: int, world: int, tmp: str) -> dict:
    return {"ddp": _twin_ddp(rank, world), "ref": _twin_reference(rank, world, tmp)}


def test_diloco_twins_and_checkpoint(tmp_path):
    res = run_ranks(_all, 2, str(tmp_path / "ckpt"), timeout_s=240)
    for rank in (0, 1):
        assert res[rank]["ddp"] < 1e-12, res[rank]["ddp"]
        ref = res[rank]["ref"]
        assert ref["err"] < 1e-10, ref
        assert ref["resume_equal"] and ref["outer_steps"] == 3
        # 3 outer all-reduces of Psi float64 (2 (R-1)/R = 1) + 6 loss scalars (8 bytes each)
        assert ref["bytes"] == 3 * ref["psi"] * 8 + 6 * 8, ref


def _composed(rank: int, world: int) -> dict:
    """DiLoCo (H 2, Nesterov, AdamW) on dp_replicate 2 x {tp, pp, cp, dp_shard} 2 against the
    hand-written outer loop over two single-process trainers (as in ``_twin_reference``)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for axis in ("tp", "pp", "cp", "dp_shard"):
        dil = _trainer(world, 2, 0.7, 0.9, **{"dp_replicate": 2, "dp_shard": 1, axis: 2})
        reps = [_trainer(1, 0, 0.7, 0.9, dp_shard=1) for _ in range(2)]
        anchor, buf = _weights(reps[0]), {}
        dp = dil.mesh.group("dp")  # replica-major: replica r reads rows [4 r, 4 r + 4)
        n = 8 // dp.size
        for s in range(4):
            x, y = global_batch(s, 8)
            dil.step(x[dp.rank * n:(dp.rank + 1) * n], y[dp.rank * n:(dp.rank + 1) * n])
            for i, tr in enumerate(reps):
                tr.step(x[i * 4:(i + 1) * 4], y[i * 4:(i + 1) * 4])
            if s % 2 == 1:
                ws = [_weights(tr) for tr in reps]
                for k in anchor:
                    g = anchor[k] - (ws[0][k] + ws[1][k]) / 2
                    buf[k] = g if k not in buf else 0.9 * buf[k] + g
                    anchor[k] = anchor[k] - 0.7 * (g + 0.9 * buf[k])
                for tr in reps:
                    tr.model.load_state_dict(anchor)
        got = dil.tensor_state()["model"]  # whole tensors under global names (this stage's under pp)
        got = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in got.items()}
        out[axis] = max(((got[k] - anchor[k]).abs().max() / anchor[k].abs().max()).item() for k in got)
    return out


@pytest.mark.slow
def test_diloco_composes_with_tp_pp_cp_dp_shard():
    """Reference: the hand-written DiLoCo of ``_twin_reference`` on the same half batches; the
    tiny model is widened to 4 heads / 2 kv heads / ffn 64 for tp 2 (1e-10, float64)."""
    res = run_ranks(_composed, 4, timeout_s=300)
    for rank, r in enumerate(res):
        assert max(r.values()) < 1e-10, (rank, r)
