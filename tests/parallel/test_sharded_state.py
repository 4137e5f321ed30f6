"""Sharded data parallel: checkpoints carry every persistent buffer, flat sharding
handles empty, scalar and tiny parameters, and every flavour is a ``GradSync``.

1. A tiny MoE (4 experts, top-2) with aux-loss-free balancing on (``moe_bias_update_rate``): the
   selection bias ``expert_bias`` is a persistent buffer that changes every step. Under DDP and
   ZeRO-1/2/3 (2 ranks) the model state dict has exactly the keys of one process's
   ``model.state_dict()``; a bias changed before a save is restored by the load; a run saved under
   ZeRO-1 after step 3 resumes under DDP (and ZeRO-3 under ZeRO-3) with the losses and biases of
   the uninterrupted DDP run. Reference: that uninterrupted run (same ranks, same microbatches).
   float64: layouts differ only in summation order (~1e-15), so 1e-9 relative; a bias left at its
   initial value (the bug) moves the loss by ~1e-4 and the bias itself by the update rate (1e-2).
2. A module holding parameters of shapes (0,), (), (1,), (2, 3) (fewer rows than 3 ranks), (5,) and
   (3, 0), under ZeRO-1/2/3 at world 1, 2 and 3 (tiny buckets, so one bucket holds only the empty
   parameter), against the same module stepped by one process on the whole batch: gradient
   norm (clipping active) and parameters after 2 AdamW steps, float64, 1e-12 (summation order).
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from ndtrain.checkpoint import dcp as ckpt
from ndtrain.config import Config, TrainingConfig
from ndtrain.mesh import ParallelDims
from ndtrain.optim import build_optimizer, clip_grad_norm
from ndtrain.parallel.api import GradSync
from ndtrain.parallel.zero.fsdp import FullyShardedDataParallel
from ndtrain.parallel.zero.zero12 import ZeroDataParallel
from ndtrain.train.loop import Trainer
from tests.dist_utils import run_ranks
from tests.utils import tiny_config

V, T, G, STEPS = 61, 8, 8, 6


def moe_cfg(zero_stage: int = 0, ep: int = 1) -> Config:
    return tiny_config({"model.dim": 16, "model.n_heads": 2, "model.n_kv_heads": 1, "model.ffn_hidden": 24,
                        "model.max_seq_len": 32, "model.moe_experts": 4, "model.moe_top_k": 2,
                        "model.moe_ffn_hidden": 16, "model.moe_bias_update_rate": 1e-2, "data.seq_len": 256,
                        "training.steps": STEPS, "training.global_batch_size": G, "training.micro_batch_size": 2,
                        "training.warmup_steps": 1}, parallel={"zero_stage": zero_stage, "ep": ep,
                                                               "bucket_size_bytes": 2048})


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(700 + step)
    x, y = torch.randint(0, V, (G, T), generator=gen), torch.randint(0, V, (G, T), generator=gen)
    local = G // world
    return x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]


def _biases(tr: Trainer) -> torch.Tensor:
    return torch.cat([b.detach().clone() for n, b in tr.model.named_buffers() if n.endswith("expert_bias")])


def _buffers_and_resume(rank: int, world: int, tmp: str) -> dict:
    out = {"keys": {}, "restored": {}, "grad_sync": {}}
    single = Trainer(moe_cfg(), ParallelDims().build_mesh(), torch.device("cpu"))
    want_keys = set(single.model.state_dict())
    out["has_bias"] = any(k.endswith("expert_bias") for k in want_keys)
    for stage in (0, 1, 2, 3):
        cfg = moe_cfg(stage)
        tr = Trainer(cfg, ParallelDims.from_config(cfg.parallel, world).build_mesh(), torch.device("cpu"))
        out["grad_sync"][stage] = isinstance(tr.dp, GradSync)
        out["keys"][stage] = set(tr.dp.model_state_dict()) == want_keys
        bufs = [b for n, b in tr.model.named_buffers() if n.endswith("expert_bias")]
        for i, b in enumerate(bufs):
            b.copy_(torch.arange(b.numel(), dtype=b.dtype) * 0.25 + i)
        saved = _biases(tr)
        path = ckpt.save_checkpoint(Path(tmp) / f"buf{stage}", 1, tr.tensor_state(), {"step": 1})
        for b in bufs:
            b.zero_()
        state = tr.tensor_state()
        ckpt.load_checkpoint(path, state)
        tr.load_tensor_state(state)
        out["restored"][stage] = torch.equal(_biases(tr), saved)
    cfg = moe_cfg(0, ep=2)
    ep_tr = Trainer(cfg, ParallelDims.from_config(cfg.parallel, world).build_mesh(), torch.device("cpu"))
    out["grad_sync"]["ep"] = isinstance(ep_tr.dp, GradSync)

    def trainer(stage: int) -> Trainer:
        cfg = moe_cfg(stage)
        return Trainer(cfg, ParallelDims.from_config(cfg.parallel, world).build_mesh(), torch.device("cpu"))

    ref = trainer(0)
    out["ref"] = [ref.step(*batch(s, rank, world))["loss"] for s in range(STEPS)]
    out["ref_bias"] = _biases(ref)
    for first, second in ((1, 0), (3, 3)):
        a = trainer(first)
        losses = [a.step(*batch(s, rank, world))["loss"] for s in range(3)]
        path = ckpt.save_checkpoint(Path(tmp) / f"resume{first}", 3, a.tensor_state(),
                                    {"scheduler": a.scheduler.state_dict()})
        b = trainer(second)
        state = b.tensor_state()
        meta = ckpt.load_checkpoint(path, state)
        b.load_tensor_state(state)
        b.scheduler.load_state_dict(meta["scheduler"])
        losses += [b.step(*batch(s, rank, world))["loss"] for s in range(3, STEPS)]
        out[f"resumed_{first}_{second}"] = (losses, _biases(b))
    return out


def test_sharded_checkpoints_carry_buffers_and_resume_across_layouts(tmp_path):
    for r in run_ranks(_buffers_and_resume, 2, str(tmp_path), timeout_s=400):
        assert r["has_bias"]
        assert all(r["grad_sync"].values()), r["grad_sync"]
        assert all(r["keys"].values()), r["keys"]
        assert all(r["restored"].values()), r["restored"]
        assert r["ref_bias"].abs().max() > 0  # the bias moved (the update is on)
        for key in ("resumed_1_0", "resumed_3_3"):
            losses, bias = r[key]
            for a, b in zip(losses, r["ref"]):
                assert abs(a - b) <= 1e-9 * b, (key, losses, r["ref"])
            assert (bias - r["ref_bias"]).abs().max() <= 1e-12, key


class _OddShapes(nn.Module):
    """Parameters of shapes (0,), (), (1,), (2, 3), (5,), (3, 0), (1, 5, 3), (2, 4, 3); forward x (B, 3)
    -> scalar. The last two are sharded along dim 1 where dim 0 is shorter than the ranks
    (``flat_shard.shard_dim``: one of them on 2 ranks, both on 3), ragged either way."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        f64 = {"dtype": torch.float64}
        self.empty = nn.Parameter(torch.zeros(0, **f64))
        self.scale = nn.Parameter(torch.tensor(1.5, **f64))
        self.one = nn.Parameter(torch.tensor([0.3], **f64))
        self.w = nn.Parameter(torch.randn(2, 3, generator=g, **f64))
        self.b = nn.Parameter(torch.randn(5, generator=g, **f64))
        self.flat = nn.Parameter(torch.zeros(3, 0, **f64))
        self.one_expert = nn.Parameter(torch.randn(1, 5, 3, generator=g, **f64))
        self.two_experts = nn.Parameter(torch.randn(2, 4, 3, generator=g, **f64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.scale * (x @ self.w.t()) + self.one  # (B, 2)
        extra = self.empty.sum() + self.flat.sum() + self.b.pow(2).sum() * self.one.sum()
        e = (x @ self.one_expert[0].t()).sin().sum() + torch.einsum("bc,efc->bef", x, self.two_experts).cos().sum()
        return h.tanh().pow(2).sum() + extra * x.shape[0] + e


def _odd_shapes(rank: int, world: int) -> dict:
    tcfg = TrainingConfig(lr=0.1, weight_decay=0.1)
    mesh = ParallelDims(dp_shard=world, world_size=world).build_mesh()
    out = {}
    for stage in (1, 2, 3):
        model = _OddShapes()
        ref = copy.deepcopy(model)
        dp = (FullyShardedDataParallel(model, mesh) if stage == 3
              else ZeroDataParallel(model, mesh, stage, bucket_size_bytes=16))
        opt, ref_opt = dp.build_optimizer(tcfg), build_optimizer(ref.named_parameters(), tcfg)
        norms = []
        for step in range(2):
            xs = torch.randn(4 * world, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
            local = xs[rank * 4:(rank + 1) * 4]
            for i in range(2):  # 2 microbatches of 2 rows
                with dp.no_sync() if i == 0 else torch.enable_grad():
                    model(local[2 * i:2 * i + 2]).backward()
            dp.finish_grad_sync()
            norm = dp.clip_grad_norm(0.1, mesh)
            opt.step()
            opt.zero_grad(set_to_none=True)
            ref(xs).backward()
            ref_norm = clip_grad_norm([(p.grad, ()) for p in ref.parameters()], 0.1)
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            norms.append((norm, ref_norm))
        sd = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in dp.model_state_dict().items()}
        want = ref.state_dict()
        out[stage] = {"norms": norms, "keys": set(sd) == set(want),
                      "shapes": all(sd[k].shape == v.shape for k, v in want.items()),
                      "err": max(((sd[k] - v).abs().max().item() if v.numel() else 0.0) for k, v in want.items())}
    return out


def _check_odd(results: list[dict]) -> None:
    for r in results:
        for stage in (1, 2, 3):
            res = r[stage]
            assert res["keys"] and res["shapes"], (stage, res)
            for norm, ref_norm in res["norms"]:
                assert ref_norm > 0.1 * 3, "clipping must be active"
                assert abs(norm - ref_norm) <= 1e-12 * ref_norm, (stage, res["norms"])
            assert res["err"] <= 1e-12, (stage, res["err"])


def test_flat_sharding_empty_scalar_and_tiny_parameters_one_process():
    _check_odd([_odd_shapes(0, 1)])


def test_flat_sharding_empty_scalar_and_tiny_parameters_two_and_three_ranks():
    for world in (2, 3):
        _check_odd(run_ranks(_odd_shapes, world, timeout_s=200))
