"""ZeRO with fewer local experts than shard ranks: expert weights sharded along dim 1.

With E/ep local experts < the ranks sharding them, rows of whole experts would leave most ranks
holding only padding (each then allocates a whole expert's worth of padded shard and moves it in
every gather / reduce-scatter); ``flat_shard.shard_dim`` shards such a weight along dim 1 (F of
w1 / w3, C of w2) instead. Checked on 4 gloo ranks, float64, 2 experts: ep2 x edp2 under ZeRO-3
(AdamW) and ZeRO-1 (Muon: dim-1 expert blocks are routed to an owner, every expert orthogonalised
whole), ep1 x dp4 under ZeRO-2 (the experts in the dense domain). Each must match the single-process
trainer (losses and every final weight to 1e-9 relative, float64: only sums are reordered); each
expert shard must hold exactly 1/N of its weight; a ZeRO-3 checkpoint of the dim-1 layout must
load bitwise under plain EP (whole local experts) and under ZeRO-2 over 4 ranks.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ndtrain.mesh import ParallelDims
from ndtrain.train.loop import Trainer
from ndtrain.train.rundir import gather_model
from tests.dist_utils import run_ranks
from tests.parallel.test_ep import G, global_batch, moe_cfg

STEPS = 3
LAYOUTS = {  # name: (ep, zero stage, optimizer)
    "ep2_zero3": (2, 3, "adamw"), "ep2_zero1_muon": (2, 1, "muon"), "ep1_zero2": (1, 2, "adamw")}


def _cfg(world: int, ep: int, zero: int, optimizer: str, micro: int = 0):
    cfg = moe_cfg(world, ep, micro, moe_experts=2)
    cfg.parallel.zero_stage, cfg.training.optimizer = zero, optimizer
    return cfg


def _trainer(cfg, world: int) -> Trainer:
    return Trainer(cfg, ParallelDims.from_config(cfg.parallel, world).build_mesh(), torch.device("cpu"))


def _train(tr: Trainer, steps: int = STEPS) -> list[float]:
    dp, rank = tr.mesh.dims.dp, tr.mesh.group("dp").rank
    local, losses = G // dp, []
    for step in range(steps):
        x, y = global_batch(step)
        losses.append(tr.step(x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local])["loss"])
    return losses


def _weights(tr: Trainer) -> dict[str, torch.Tensor] | None:
    model = gather_model(tr, tr.cfg)
    return None if model is None else {k: v.detach().clone() for k, v in model.state_dict().items()}


def _expert_shares(tr: Trainer) -> list[tuple[str, int, int, int, int]]:
    """(name, shard dim, shard numel, ranks sharding it, rank-local numel) of each expert entry."""
    return [(e.fqn, e.layout.dims[e.index], e.param.numel(), e.domain.shard_group.size, e.shape.numel())
            for e in tr.dp.entries if ".experts." in e.fqn]


def _ranks(rank: int, world: int, ckpt_dir: str) -> dict:
    from ndtrain.checkpoint import dcp as ckpt

    out = {}
    for name, (ep, zero, opt) in LAYOUTS.items():
        ref = _trainer(_cfg(1, 1, 0, opt, micro=G // world), 1)
        ref_losses, ref_w = _train(ref), _weights(ref)
        tr = _trainer(_cfg(world, ep, zero, opt), world)
        losses = _train(tr)
        w = _weights(tr)
        out[name] = {"losses": (losses, ref_losses), "shares": _expert_shares(tr),
                     "weights": None if w is None else max(
                         ((w[k] - v).abs().max() / v.abs().max().clamp(min=1e-30)).item() for k, v in ref_w.items())}
        if name == "ep2_zero3":
            src_w = w
            path = ckpt.save_checkpoint(Path(ckpt_dir), STEPS, tr.tensor_state(), {"step": STEPS})
    loads = {}
    for name, (ep, zero) in {"ep2_zero0": (2, 0), "ep1_zero2": (1, 2)}.items():
        dst = _trainer(_cfg(world, ep, zero, "adamw"), world)
        state = dst.tensor_state()
        ckpt.load_checkpoint(path, state)
        dst.load_tensor_state(state)
        w = _weights(dst)
        loads[name] = None if w is None else all(torch.equal(w[k], v) for k, v in src_w.items())
    out["loads"] = loads
    return out


def test_zero_shards_few_experts_along_dim1_and_matches_single_process(tmp_path):
    res = run_ranks(_ranks, 4, str(tmp_path), timeout_s=400)
    for rank, r in enumerate(res):
        for name in LAYOUTS:
            losses, ref = r[name]["losses"]
            assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref)) <= 1e-9, (name, losses, ref)
            shares = r[name]["shares"]
            assert len(shares) == 3 * 2, shares  # w1, w2, w3 of 2 MoE layers
            for fqn, dim, numel, n, local in shares:
                assert n > 1 and dim == 1 and numel * n == local, (name, fqn, dim, numel, n, local)
            if rank == 0:
                assert r[name]["weights"] <= 1e-9, (name, r[name]["weights"])
    assert res[0]["loads"] == {"ep2_zero0": True, "ep1_zero2": True}, res[0]["loads"]
