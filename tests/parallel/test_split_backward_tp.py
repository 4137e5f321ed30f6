"""The split backward's W pass under tensor-parallel experts (``parallel.expert_tp = tp``).

``SplitExpertsTP`` ends in a reduce-scatter all-to-all over tp whose backward B already ran; W
must reach the expert weights through the local GEMMs only (``weight_grad_output``), or it repeats
that all-to-all (+13% tp bytes per step on this model before the fix). One 4-rank spawn, float64:
pp2 x tp2 with ``expert_tp=2`` under 1F1B and ZB-H1 train the same 2 steps; the losses and grad
norms must be equal (ZB-H1 only reorders the same sums: 1e-12 relative) and the bytes moved on every
mesh axis exactly equal (the W pass adds no collective). The same for a dense pp2 x tp2 + SP
model, whose column linears all-gather their saved sequence shard for the weight gradient: in W
only, once.
"""
from __future__ import annotations

import torch

from ndtrain.config import load_config
from ndtrain.mesh import ParallelDims
from tests.dist_utils import run_ranks

OVER = {"model.n_layers": 4, "model.dim": 32, "model.vocab_size": 61, "model.moe_experts": 4,
        "model.moe_top_k": 2, "model.moe_ffn_hidden": 16, "data.seq_len": 16, "training.dtype": "float64",
        "training.global_batch_size": 4, "training.micro_batch_size": 1, "parallel.pp": 2,
        "parallel.tp": 2, "parallel.expert_tp": 2}


# Dense pp2 x tp2 + SP: the column linears' backward all-gathers its saved sequence shard only
# where the weight gradient is taken (W), never in B as well (ndtrain.parallel.tp.sp_linear).
SP_OVER = {k: v for k, v in OVER.items() if not k.startswith(("model.moe", "parallel.expert"))}
SP_OVER["parallel.sequence_parallel"] = True


def _train(schedule: str, world: int, preset: str = "moe_debug", over: dict = OVER) -> list[dict]:
    from ndtrain.train.loop import Trainer

    cfg = load_config(preset, {**over, "parallel.pp_schedule": schedule}, world_size=world)
    mesh = ParallelDims.from_config(cfg.parallel, world).build_mesh()
    tr = Trainer(cfg, mesh, torch.device("cpu"))
    rows = []
    for step in range(2):
        g = torch.Generator().manual_seed(100 + step)
        seq = torch.randint(0, 61, (4, 17), generator=g)
        mesh.reset_stats()
        out = tr.step(seq[:, :-1], seq[:, 1:])
        rows.append({"loss": out["loss"], "grad_norm": out["grad_norm"], "bytes": dict(mesh.stats)})
    return rows


def _rank(rank: int, world: int) -> dict:
    """Both schedules' steps, and what ZB-H1's W passes received: how many times an expert layer's
    recorded output (``in_w``) and an expert weight differentiated in B (``in_b``) came up."""
    from ndtrain.parallel.pp import runtime
    from ndtrain.parallel.tp.moe_layers import SplitExpertsTP

    torch.set_num_threads(1)
    seen = {"in_w": 0, "in_b": 0}
    real = runtime.accumulate_weight_grads

    def spy(wgrads, direct, **kw):
        seen["in_w"] += sum(isinstance(mod, SplitExpertsTP) for (mod, _), _ in wgrads)
        seen["in_b"] += sum(p.dim() == 3 for p, _ in direct)  # stacked (E, ., .) expert weights
        return real(wgrads, direct, **kw)

    runtime.accumulate_weight_grads = spy
    try:
        out = {s: _train(s, world) for s in ("1f1b", "zero_bubble")}
    finally:
        runtime.accumulate_weight_grads = real
    sp = {s: _train(s, world, "debug", SP_OVER) for s in ("1f1b", "zero_bubble")}
    return {**out, "seen": seen, "sp": sp}


def test_zero_bubble_w_pass_repeats_no_tp_all_to_all():
    """Also: the expert weights' gradients stay deferred to W -- each rank's 2 MoE layers x 4
    microbatches x 2 steps recorded outputs reach W -- and none is taken in B instead."""
    for r in run_ranks(_rank, 4):
        assert r["seen"] == {"in_w": 2 * 4 * 2, "in_b": 0}, r["seen"]
        for a, b in zip(r["1f1b"], r["zero_bubble"]):
            assert abs(a["loss"] - b["loss"]) <= 1e-12 * abs(a["loss"])
            assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-12 * a["grad_norm"]
            assert a["bytes"]["tp"] > 0 and a["bytes"] == b["bytes"], (a["bytes"], b["bytes"])
        for a, b in zip(r["sp"]["1f1b"], r["sp"]["zero_bubble"]):  # dense tp2 + SP
            assert abs(a["loss"] - b["loss"]) <= 1e-12 * abs(a["loss"])
            assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-12 * a["grad_norm"]
            assert a["bytes"]["tp"] > 0 and a["bytes"] == b["bytes"], (a["bytes"], b["bytes"])
