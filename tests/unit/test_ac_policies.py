"""The op-level, core-attention and DeepSeek-style activation-checkpointing policies (single process).

References: the un-checkpointed model (every recompute replays the same float64 ops on CPU, so the
gradients must be *bitwise* equal to ``none``), and the bytes kept between forward and backward
measured by ``ActivationMeter`` (each policy keeps less than ``none`` and more than ``full``).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ndtrain.config import ConfigError, load_config
from ndtrain.mem_account import ActivationMeter
from ndtrain.model import build_model
from ndtrain.parallel.ac_policy import POLICIES, every_blocks, example_policies, parse_policy
from ndtrain.parallel.activation_ckpt import apply_activation_checkpoint
from ndtrain.parallel.rules import check_activation_checkpoint

NEW = ("op", "core_attn", "deepseek")
MLA = {"model.attention": "mla", "model.mla_q_rank": 16, "model.mla_kv_rank": 12, "model.mla_rope_dim": 4,
       "model.mla_nope_dim": 8}
MODELS = {  # name -> (layer pattern, overrides): dense GQA, MLA + MoE, a hybrid of every mixer
    "gqa": ("AA", {}),
    "mla_moe": ("AA", {**MLA, "model.moe_experts": 4, "model.moe_top_k": 2, "model.moe_ffn_hidden": 16}),
    "hybrid": ("GLSM", {}),
}


def test_new_policies_parse_and_validate():
    assert parse_policy("op", 8) == ("selective", 1)
    assert parse_policy("core_attn", 8) == parse_policy("deepseek", 8) == ("parts", 0)
    assert all(p in POLICIES and p in example_policies() for p in NEW)
    assert [every_blocks(p, 16) for p in NEW] == [0, 0, 0]
    for p in NEW:
        check_activation_checkpoint(p)
    with pytest.raises(ConfigError, match="core_attn"):
        check_activation_checkpoint("deep_seek")


def _run(name: str, ac: str, documents: bool):
    pattern, over = MODELS[name]
    ov = {"model.layer_pattern": pattern, "model.n_layers": len(pattern), "model.dim": 32, "model.n_heads": 4,
          "model.n_kv_heads": 2, "model.vocab_size": 64, "model.max_seq_len": 64, "model.swa_window": 3,
          "model.linear_chunk_size": 4, "model.ffn_hidden": 48, **over}
    torch.manual_seed(0)
    model = build_model(load_config("debug", ov).model, dtype=torch.float64)
    apply_activation_checkpoint(model, ac)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 64, (2, 32), generator=g), torch.randint(0, 64, (2, 32), generator=g)
    docs = torch.tensor([[0] * 10 + [1] * 22, [0] * 32]) if documents else None
    with ActivationMeter(model.parameters()) as meter:
        loss = F.cross_entropy(model(x, documents=docs).flatten(0, 1), y.flatten())
        kept = meter.current
        loss.backward()
    return [p.grad.clone() for p in model.parameters()], kept


@pytest.mark.parametrize("name", ["gqa", "mla_moe", pytest.param("hybrid", marks=pytest.mark.slow)])
def test_policies_give_bitwise_none_gradients_and_keep_between_full_and_none(name):
    documents = name == "gqa"  # packed documents: block-causal masks through the recomputed cores
    base, kept_none = _run(name, "none", documents)
    _, kept_full = _run(name, "full", documents)
    for ac in NEW:
        grads, kept = _run(name, ac, documents)
        assert all(torch.equal(a, b) for a, b in zip(base, grads)), (name, ac)
        assert kept_full < kept < kept_none, (name, ac, kept_full, kept, kept_none)


def test_deepseek_drops_mla_heads_and_norm_outputs():
    """MLA keeps only its latents under ``deepseek``: per layer at least the per-head q, k (H x 12)
    and v (H x 8) of B*T tokens in float64, plus one normalised (B, T, C) copy per block norm."""
    _, kept_none = _run("mla_moe", "none", False)
    _, kept_ds = _run("mla_moe", "deepseek", False)
    tokens, heads = 2 * 32, 4
    qkv = tokens * heads * (12 + 12 + 8) * 8
    norms = 2 * tokens * 32 * 8
    assert kept_none - kept_ds >= 2 * (qkv + norms)


def test_planner_knows_every_policy():
    """Every policy the trainer has gets an activation estimate and a recompute cost: per layer
    ``none`` > ``core_attn`` > ``deepseek`` > ``op`` (8B, fused attention, T 8192) and ``full``
    least; MLA's ``deepseek`` keeps less than its ``core_attn``; the attention recompute is
    charged to ``core_attn`` (as ``selective``) and not to ``op``."""
    from ndtrain.planner import Cluster, Workload, estimate_memory, estimate_step_time, get_accelerator, parse_layout
    from ndtrain.planner.model_spec import load_model_spec

    cl = Cluster(get_accelerator("H100"), 8)
    w = Workload(seq_len=8192, global_batch_tokens=8 * 8192)
    for preset in ("llama3_8b", "deepseek_v3"):
        spec, _ = load_model_spec(preset)
        act, step = {}, {}
        for ac in example_policies():
            lay = parse_layout(f"tp=8,dp_shard=1,ac={ac}")
            act[ac] = estimate_memory(spec, w, lay, 80e9).breakdown["activations"]
            step[ac] = estimate_step_time(spec, cl, w, lay).step_time_s
        assert act["none"] > act["core_attn"] > act["full"] and act["none"] > act["op"] > act["full"], preset
        assert act["none"] > act["deepseek"] > act["full"], preset
        assert step["core_attn"] == pytest.approx(step["selective"]) and step["op"] < step["core_attn"]
        assert step["none"] == pytest.approx(step["op"]) and step["full"] > step["core_attn"]
        if preset == "deepseek_v3":
            assert act["deepseek"] < act["core_attn"]
        else:
            assert act["core_attn"] > act["deepseek"] > act["op"]
