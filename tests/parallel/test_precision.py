"""fp16 dynamic loss scaling under data parallel: an overflow on one rank skips the step on all.

Setup: 2 ranks, ``training.dtype=float16`` (fp16 autocast, fp32 masters), initial scale 1024,
growth after 3 good steps. After the gradient sync of step 4, rank 1 alone writes +inf into one
element of its (sharded or replicated) gradient. Expected on *both* ranks, for plain DDP and ZeRO-3:
step 4 is skipped (weights, Adam step counts and the LR schedule unchanged), the scale goes
1024, 1024, 2048 (grown after 3 good steps), 1024 (halved at the overflow), 1024, 1024, 2048, and
no other step is skipped. Exact comparisons: the flags and scales are the same floats everywhere.

In the same processes, bf16 runs of ZeRO-2 / ZeRO-3 with ``parallel.grad_reduce_dtype`` float32 and
bfloat16: the reduce-scatter bytes follow the reduce dtype (4 or 2 bytes) while the all-gathers
move bf16 (2 bytes), exactly as the formulas of ``zero12.py`` / ``fsdp.py`` say.
"""
from __future__ import annotations

import torch

from ndtrain.mesh import ParallelDims
from ndtrain.train.loop import Trainer
from tests.dist_utils import run_ranks
from tests.parallel.test_zero import MICRO, global_batch, psi_pad, tiny_cfg

INJECT = 3  # 0-based step whose gradients overflow on rank 1


def _weights(tr: Trainer) -> dict:
    from torch.distributed.tensor import DTensor

    sd = tr.dp.model_state_dict()
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in sd.items()}


def _overflow(rank: int, world: int) -> dict:
    out = {}
    for stage in (0, 3):
        cfg = tiny_cfg(8, 1, zero_stage=stage)
        cfg.training.dtype = "float16"
        cfg.training.loss_scale_init, cfg.training.loss_scale_growth_interval = 1024.0, 3
        tr = Trainer(cfg, ParallelDims.from_config(cfg.parallel, world).build_mesh(), torch.device("cpu"))
        sync = tr.dp.finish_grad_sync

        def inject(sync=sync, tr=tr):
            sync()
            if rank == 1 and tr.step_count == INJECT:
                grads = [p.grad for g in tr.optimizer.param_groups for p in g["params"] if p.grad is not None]
                grads[-1].view(-1)[0] = float("inf")

        tr.dp.finish_grad_sync = inject
        rows, unchanged = [], None
        first = tr.optimizer.param_groups[0]["params"][0]
        for s in range(7):
            x, y = global_batch(s, 8)
            before = _weights(tr) if s == INJECT else None
            res = tr.step(x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4])
            if before is not None:
                after = _weights(tr)
                unchanged = all(torch.equal(before[k], after[k]) for k in before)
            rows.append((res["skipped"], res["loss_scale"], tr.scheduler.last_epoch,
                         tr.optimizer.state[first]["step"].item()))
        out[stage] = {"rows": rows, "unchanged": unchanged, "loss": res["loss"]}
    out["traffic"] = {}
    for stage in (2, 3):
        for rd in ("float32", "bfloat16"):
            cfg = tiny_cfg(8, 1, zero_stage=stage, grad_reduce_dtype=rd)
            cfg.training.dtype = "bfloat16"
            mesh = ParallelDims.from_config(cfg.parallel, world).build_mesh()
            tr = Trainer(cfg, mesh, torch.device("cpu"))
            x, y = global_batch(0, 8)
            mesh.reset_stats()
            tr.step(x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4])
            out["traffic"][(stage, rd)] = mesh.reset_stats()["dp_shard_cp"]
    out["psi"] = psi_pad(tr.model, world)
    out["psi_head"] = psi_pad(tr.model, world, ("norm.", "output."))
    return out


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere_and_halves_the_scale():
    want = [(False, 1024.0, 1, 1.0), (False, 1024.0, 2, 2.0), (False, 2048.0, 3, 3.0),
            (True, 1024.0, 3, 3.0), (False, 1024.0, 4, 4.0), (False, 1024.0, 5, 5.0),
            (False, 2048.0, 6, 6.0)]
    for r in run_ranks(_overflow, 2):
        for stage in (0, 3):
            assert r[stage]["rows"] == want, (stage, r[stage]["rows"])
            assert r[stage]["unchanged"], stage
            assert 3.5 < r[stage]["loss"] < 4.5  # trained in fp16 without blowing up (ln 61 = 4.1)
        ring, head, norm = 0.5 * r["psi"], 0.5 * r["psi_head"], 0.5 * 8 * 2  # N = 2; grad-norm scalar
        for rd, b_r in (("float32", 4), ("bfloat16", 2)):
            assert r["traffic"][(2, rd)] == ring * (MICRO * b_r + 2) + norm
            assert r["traffic"][(3, rd)] == MICRO * (ring * 2 + (ring - head) * 2 + ring * b_r) + norm
