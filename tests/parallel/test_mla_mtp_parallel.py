"""MLA and MTP (DeepSeek-V2 / V3) under tensor, sequence and context parallel and ZeRO-3, against
the single-process oracle.

Model: a tiny dense DeepSeek-like decoder, 2 MLA layers (query latent, q / k head dim
d_n + d_r = 12 and value head dim d_v = 6, so the ring's v width differs from q / k's) and 2 MTP
depths (so the shifted tokens cross cp chunk boundaries by 1 and 2 positions), untied head.

Reference: the same ``Trainer`` with a world-size-1 layout on the whole global batch. Per step the
loss, the gradient norm before clipping (clipping active), both MTP depth losses and every
parameter's gradient as the optimizer sees it (TP shards reassembled); at the end every parameter.
Tolerance 1e-6 relative in float64 (the issue's contract): these layouts only reorder float64 sums
(split matmuls, all-reduces, online-softmax merges) and, for MTP under SP / CP, run each depth on
all positions with padded tails whose labels are ignored and which causal attention keeps from the
real positions: ~1e-13 after 10 AdamW steps. One 4-rank spawn runs every layout.

MoE in the MTP depths (``MOE_LAYOUTS``): the same model with a DeepSeek-V3-like MoE second layer
(so the MTP blocks are MoE too): sigmoid group-limited top-2 of 8 experts, a shared expert, routed
scaling, aux-loss-free bias, Switch + sequence-wise + z losses and capacity dropping (cf 1.0),
microbatches of 2 sequences in every run. Under cp, SP, cp x SP and tp without SP (which then also runs the
depths padded: a tp rank routes T / tp positions) the padded tail is masked out of the MTP blocks'
MoE layers (``MoE.token_mask``); additionally compared per step: the aux loss and each aux term,
the logged loads and the dropped fraction, and at the end the expert biases (in the state dict).
"""
from __future__ import annotations

import pytest
import torch

from ndtrain.config import Config
from ndtrain.mesh import ParallelDims
from ndtrain.train.loop import Trainer
from tests.dist_utils import run_ranks
from tests.parallel.layout_parity import (
    STEPS,
    G,
    _expected_local,
    _full_param,
    _record_grads,
    global_batch,
)
from tests.utils import rel_err, tiny_config

MLA = {"attention": "mla", "mla_q_rank": 16, "mla_kv_rank": 12, "mla_rope_dim": 4, "mla_nope_dim": 8,
       "mla_v_dim": 6}
LAYOUTS = {  # name -> parallel config on 4 ranks
    "tp2_dp2": {"tp": 2},
    "tp2_sp_dp2": {"tp": 2, "sequence_parallel": True},
    "cp2_ring_dp2": {"cp": 2, "cp_impl": "ring"},
    "cp2_ulysses_tp2_sp": {"cp": 2, "cp_impl": "ulysses", "tp": 2, "sequence_parallel": True},
    "zero3_dp2_cp2_ring": {"cp": 2, "cp_impl": "ring", "zero_stage": 3},
    "zero3_dp2_tp2_sp": {"tp": 2, "sequence_parallel": True, "zero_stage": 3},
}
MTP_KEYS = ("mtp_loss_1", "mtp_loss_2")
MOE = {"moe_experts": 8, "moe_top_k": 2, "moe_ffn_hidden": 16, "moe_shared_experts": 1, "moe_score": "sigmoid",
       "moe_n_groups": 4, "moe_topk_groups": 2, "moe_route_scale": 2.5, "moe_layer_start": 1,
       "moe_bias_update_rate": 0.01, "moe_aux_loss_coef": 0.01, "moe_seq_aux_loss_coef": 0.01,
       "moe_z_loss_coef": 0.001, "moe_capacity_factor": 1.0}
MOE_LAYOUTS = {  # MoE + MTP: the padded MTP tail masked out of the MoE layers
    "moe_cp2_ring_dp2": {"cp": 2, "cp_impl": "ring"},
    "moe_tp2_sp_dp2": {"tp": 2, "sequence_parallel": True},
    "moe_tp2_dp2": {"tp": 2},
    "moe_cp2_ring_tp2_sp": {"cp": 2, "cp_impl": "ring", "tp": 2, "sequence_parallel": True},
}
MOE_KEYS = ("aux_loss", "aux_switch", "aux_seq", "aux_z", "moe_load_max_mean", "moe_tokens_per_expert_max",
            "moe_dropped_frac")


def mla_mtp_cfg(world: int = 1, moe: bool = False, **par) -> Config:
    return tiny_config({"model.n_kv_heads": 4, "model.mtp_depth": 2, "model.mtp_loss_weight": 0.3,
                        "training.micro_batch_size": 2 if moe else 0}, world=world,
                       model={**MLA, **(MOE if moe else {})}, parallel={"dp_shard": -1, **par})


def _reference(moe: bool = False) -> dict:
    ref = Trainer(mla_mtp_cfg(moe=moe), ParallelDims(world_size=1).build_mesh(), torch.device("cpu"))
    grads: list = []
    _record_grads(ref, grads)
    steps = [ref.step(*global_batch(s)) for s in range(STEPS)]
    return {"steps": steps, "grads": grads,
            "params": {n: p.detach().clone() for n, p in ref.dp.model_state_dict().items()}}


def _run_layout(rank: int, world: int, ref: dict, par: dict, moe: bool = False) -> dict:
    cfg = mla_mtp_cfg(world, moe, **par)
    mesh = ParallelDims.from_config(cfg.parallel, world).build_mesh()
    tr = Trainer(cfg, mesh, torch.device("cpu"))
    got: list = []
    _record_grads(tr, got)
    tp, dp = mesh.group("tp"), mesh.group("dp")
    local = G // dp.size
    out = {k: 0.0 for k in ("loss", "grad_norm", "mtp", "grad", "param")}
    for step in range(STEPS):
        inputs, labels = global_batch(step)
        sl = slice(dp.rank * local, (dp.rank + 1) * local)
        d, r = tr.step(inputs[sl], labels[sl]), ref["steps"][step]
        for key in ("loss", "grad_norm"):
            out[key] = max(out[key], abs(d[key] - r[key]) / abs(r[key]))
        out["mtp"] = max([out["mtp"]] + [abs(d[k] - r[k]) / abs(r[k]) for k in MTP_KEYS])
        if moe:
            out["moe"] = max([out.get("moe", 0.0)] + [abs(d[k] - r[k]) / max(abs(r[k]), 1e-30) for k in MOE_KEYS])
        assert got[step].keys() == ref["grads"][step].keys()
        for name, g in ref["grads"][step].items():
            out["grad"] = max(out["grad"], rel_err(got[step][name], _expected_local(tr, name, g, tp)))
    for name, value in tr.dp.model_state_dict().items():
        out["param"] = max(out["param"], rel_err(_full_param(tr, name, value, tp), ref["params"][name]))
    out["local_shapes"] = {n: tuple(p.shape) for n, p in tr.model.named_parameters()}
    out["units"] = [u.name for u in getattr(tr.dp, "units", [])]
    out["has_shift"] = getattr(tr.model, "mtp_shift", None) is not None
    return out


def _all_layouts(rank: int, world: int) -> dict:
    ref = _reference()
    res = {name: _run_layout(rank, world, ref, par) for name, par in LAYOUTS.items()}
    res["ref_gn0"] = ref["steps"][0]["grad_norm"]
    res["ref_mtp"] = [s["mtp_loss_2"] for s in ref["steps"]]
    ref = _reference(moe=True)
    res.update({name: _run_layout(rank, world, ref, par, moe=True) for name, par in MOE_LAYOUTS.items()})
    res["moe_ref"] = {"steps": ref["steps"], "bias": {n: v for n, v in ref["params"].items() if "expert_bias" in n}}
    return res


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all_layouts, 4, timeout_s=600.0)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(results, layout):
    for r in results:
        for key in ("loss", "grad_norm", "mtp", "grad", "param"):
            assert r[layout][key] < 1e-6, (layout, key, r[layout][key])
    assert results[0]["ref_gn0"] > 0.05, "clipping should be active"
    assert all(v > 0 for v in results[0]["ref_mtp"])  # depth 2 trains on real targets


def test_mla_heads_split_and_latents_replicated(results):
    """tp=2: per-head projections hold half the rows / columns, the latent path stays whole."""
    shapes = results[0]["tp2_dp2"]["local_shapes"]
    h, qk, nv = 4, 8 + 4, 8 + 6
    att = "layers.0.attention"
    assert shapes[f"{att}.wq_b.weight"] == (h // 2 * qk, 16)
    assert shapes[f"{att}.wkv_b.weight"] == (h // 2 * nv, 12)
    assert shapes[f"{att}.wo.weight"] == (32, h // 2 * 6)
    assert shapes[f"{att}.wq_a.weight"] == (16, 32) and shapes[f"{att}.wkv_a.weight"] == (12 + 4, 32)
    assert shapes["mtp.1.block.attention.wkv_b.weight"] == (h // 2 * nv, 12)
    assert shapes["mtp.1.block.feed_forward.w1.weight"] == (24, 32)
    assert shapes["mtp.1.proj.weight"] == (32, 64)


def test_mtp_hooks_and_fsdp_units(results):
    r = results[0]
    assert not r["tp2_dp2"]["has_shift"]  # truncated depths, as in one process
    assert all(r[k]["has_shift"] for k in ("tp2_sp_dp2", "cp2_ring_dp2", "cp2_ulysses_tp2_sp"))
    assert r["zero3_dp2_cp2_ring"]["units"] == ["tok_embeddings", "layers.0", "layers.1", "head", "mtp.0", "mtp.1"]


@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_moe_mtp_layout_matches_single_process(results, layout):
    """MoE in the MTP blocks under cp2 ring, tp2 + SP, tp2 without SP and cp2 x tp2 + SP (two
    microbatches per rank; the mask is cut to the cp chunks, then to the tp pieces): losses, gradients,
    parameters and every MoE statistic equal the single process's (the padded MTP tail masked)."""
    for r in results:
        for key in ("loss", "grad_norm", "mtp", "grad", "param", "moe"):
            assert r[layout][key] < 1e-6, (layout, key, r[layout][key])
        assert r[layout]["has_shift"]  # every one of these runs the depths padded
    steps = results[0]["moe_ref"]["steps"]
    assert min(s["moe_dropped_frac"] for s in steps) > 0.05  # capacity really drops
    assert all(s[k] > 0 for s in steps for k in ("aux_switch", "aux_seq", "aux_z"))
    biases = results[0]["moe_ref"]["bias"]
    assert sorted(biases) == ["layers.1.feed_forward.expert_bias", "mtp.0.block.feed_forward.expert_bias",
                              "mtp.1.block.feed_forward.expert_bias"]
    assert all(b.abs().max() > 0 for b in biases.values())  # the aux-loss-free bias moved (and matched)


def test_mtp_with_moe_rules_accept():
    """The rules that rejected MoE in padded MTP depths are gone (the tail is masked)."""
    from ndtrain.parallel.cp import rules as cp_rules
    from ndtrain.parallel.tp import rules as tp_rules

    cp_rules.check(2, 16, mla=True, mtp=True, moe=True, capacity=True, seq_aux_loss=True)
    tp_rules.check(2, 4, 4, 48, True, moe=True, mtp=True)
    for par in MOE_LAYOUTS.values():
        mla_mtp_cfg(4, moe=True, **par)


def test_dense_mla_mtp_layouts_validate():
    for par in LAYOUTS.values():
        mla_mtp_cfg(4, **par)


def test_ring_blocks_with_value_dim_unlike_key_dim():
    """The ring's block steps with Dv != D (MLA: q / k carry the RoPE dims, v does not) and GQA,
    simulated in one process (``simulate_ring_attention``, the arithmetic every rank runs), equal
    full causal attention and its gradients (float64, 1e-10)."""
    import torch.nn.functional as F

    from ndtrain.parallel.cp.context_parallel import local_positions, shard_sequence, unshard_sequence
    from ndtrain.parallel.cp.ring import simulate_ring_attention

    g = torch.Generator().manual_seed(0)
    b, h, kv, t, d, dv, cp = 2, 4, 2, 16, 12, 6, 2
    q, k = torch.randn(b, h, t, d, generator=g, dtype=torch.float64), torch.randn(b, kv, t, d, generator=g,
                                                                                 dtype=torch.float64)
    v, dout = torch.randn(b, kv, t, dv, generator=g, dtype=torch.float64), torch.randn(b, h, t, dv, generator=g,
                                                                                      dtype=torch.float64)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
    ref.backward(dout)
    lay = "load_balanced"
    pos = torch.stack([local_positions(t, cp, r, lay) for r in range(cp)])

    def sh(x):
        return [shard_sequence(x, cp, r, lay, dim=2) for r in range(cp)]

    outs, backward = simulate_ring_attention(sh(q), sh(k), sh(v), pos, pos, True)
    grads = backward(sh(dout))
    assert outs[0].shape == (b, h, t // cp, dv)
    for got, want in zip([outs, *grads], [ref, *(x.grad for x in leaves)]):
        assert (unshard_sequence(got, lay, dim=2) - want).abs().max() < 1e-10
