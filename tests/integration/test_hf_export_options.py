"""Exports compute what ndtrain computes: every shipped preset (shrunk, its options kept) and one
native model per family with every epsilon / theta / option away from transformers' defaults is
exported, loaded with ``AutoModelForCausalLM`` and its logits compared with the native model's.

Reference: ndtrain's single-process model in float64. Tolerance 1e-5 absolute on O(1) logits: the
two compute the same operations in float64 in another order (~1e-12); a field transformers takes
from its own defaults (an epsilon of 0.3 against 1e-6, a theta of 77 against 1e4, a lost gate)
moves logits by far more. A model whose options a family cannot express is refused before
training (``export_problem``, printed at launch) with the rule."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ndtrain.config import ModelConfig, load_config
from ndtrain.hf.folder import save_hf_checkpoint
from ndtrain.hf.rules import export_family, export_note, export_problem
from ndtrain.model import build_model

transformers = pytest.importorskip("transformers", reason="the export checks load the folders with transformers")

PRESETS = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "ndtrain" / "configs").glob("*.yaml"))
_BIG = {"model.dim": 64, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2, "model.ffn_hidden": 96}
SHRINK = {
    "default": {"model.dim": 48, "model.n_layers": 2, "model.ffn_hidden": 64},
    "llama3_8b": _BIG, "llama3_70b": _BIG, "llama3_405b": _BIG,
    "mixtral_8x7b": {**_BIG, "model.moe_experts": 4, "model.moe_ffn_hidden": 32},
    "deepseek_v3": {"model.dim": 64, "model.n_layers": 3, "model.n_heads": 4, "model.ffn_hidden": 96,
                    "model.mla_q_rank": 32, "model.mla_kv_rank": 16, "model.mla_rope_dim": 8,
                    "model.mla_nope_dim": 16, "model.mla_v_dim": 16, "model.moe_experts": 8, "model.moe_top_k": 2,
                    "model.moe_n_groups": 4, "model.moe_topk_groups": 2, "model.moe_ffn_hidden": 32,
                    "model.moe_layer_start": 1},
    "qwen3_next_80b": {"model.dim": 64, "model.n_layers": 4, "model.n_heads": 4, "model.attn_head_dim": 16,
                       "model.ffn_hidden": 96, "model.linear_heads": 2, "model.linear_key_head_dim": 16,
                       "model.linear_value_heads": 4, "model.linear_value_head_dim": 16, "model.moe_experts": 4,
                       "model.moe_top_k": 2, "model.moe_ffn_hidden": 32, "model.linear_chunk_size": 8},
}


def _logits_match(cfg: ModelConfig, folder: Path, seed: int = 0) -> float:
    """Export a randomly initialised float64 model of ``cfg``; returns max |HF - ndtrain| logits."""
    torch.manual_seed(seed)
    model = build_model(cfg, seed=seed).to(torch.float64).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or ".norm." in name or name.endswith("_norm.weight"):
                p.add_(0.2 * torch.randn_like(p))  # norms away from 1 (HF zero-centres some of them)
    save_hf_checkpoint(model, cfg, folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(  # eager experts: grouped_mm has no float64
        folder, torch_dtype=torch.float64, experts_implementation="eager").eval()
    x = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        want = model(x)
        got = hf(x).logits
    assert want.abs().max() > 0.1  # O(1) logits: the comparison has something to see
    return (got - want).abs().max().item()


# presets that are no Hugging Face model as they are: the rule launch prints before training
REFUSED = {"hybrid_debug": (
    "ndtrain convert --to-hf will refuse this model: Hugging Face export: Qwen3-Next export: softmax layers "
    "need attention mha with qk_norm and attn_output_gate; Qwen3-Next has one rms_norm_eps for every norm, "
    "the Gated DeltaNet's gated norm included; set model.linear_norm_eps (1e-06) equal to model.norm_eps "
    "(1e-05); a shared expert needs moe_shared_gate")}


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_exports_with_matching_logits_or_is_refused_up_front(preset, tmp_path, capsys):
    over = {"model.vocab_size": 96, "model.max_seq_len": 32, "data.seq_len": 16, **SHRINK.get(preset, {})}
    cfg = load_config(preset, over, world_size=1)
    from ndtrain.cli.launch import _announce

    _announce(True, tmp_path / "run", cfg)  # what `ndtrain train` prints before any process starts
    notes = [line for line in capsys.readouterr().out.splitlines() if "convert --to-hf" in line]
    if preset in REFUSED:
        assert export_note(cfg.model) == REFUSED[preset] and notes == [f"note: {REFUSED[preset]}"]
        with pytest.raises(ValueError, match="Qwen3-Next export: softmax layers need"):
            save_hf_checkpoint(build_model(cfg.model), cfg.model, tmp_path / "never")
        assert not (tmp_path / "never").exists()
        return
    assert export_problem(cfg.model) is None and notes == [], export_problem(cfg.model)
    assert _logits_match(cfg.model, tmp_path / preset) <= 1e-5


# one native model per family, each option off transformers' default (and off ndtrain's)
_BASE = dict(vocab_size=80, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=32,
             norm_eps=0.3, rope_theta=77.0, init_std=0.1)
FAMILIES = {
    "llama": dict(_BASE, tie_embeddings=True, attn_head_dim=12, rope_scaling=True, rope_scaling_factor=3.0,
                  rope_low_freq_factor=1.5, rope_high_freq_factor=3.5, rope_original_max_seq_len=8),
    "mixtral": dict(_BASE, moe_experts=4, moe_top_k=3, moe_ffn_hidden=24),
    "deepseek_v3": dict(_BASE, n_layers=3, attention="mla", mla_q_rank=16, mla_kv_rank=12, mla_rope_dim=4,
                        mla_nope_dim=6, mla_v_dim=10, moe_experts=8, moe_top_k=3, moe_shared_experts=2,
                        moe_ffn_hidden=16, moe_score="sigmoid", moe_renormalize=False, moe_route_scale=1.7,
                        moe_n_groups=4, moe_topk_groups=3, moe_layer_start=1),
    "qwen3_moe": dict(_BASE, n_layers=3, qk_norm=True, attn_head_dim=12, moe_experts=4, moe_top_k=3,
                      moe_ffn_hidden=20, moe_renormalize=False, moe_layer_start=1, moe_layer_interleave=2),
    "qwen3_next": dict(_BASE, n_layers=3, qk_norm=True, attn_output_gate=True, attn_head_dim=12,
                       rope_partial_factor=0.5, layer_pattern="GGA", linear_heads=2,
                       linear_key_head_dim=8, linear_value_heads=4, linear_value_head_dim=6, linear_conv_kernel=3,
                       linear_norm_eps=0.3, linear_chunk_size=4, moe_experts=4, moe_top_k=3, moe_ffn_hidden=16,
                       moe_shared_experts=1, moe_shared_ffn_hidden=20, moe_shared_gate=True,
                       moe_renormalize=False),
    "mamba2": dict(_BASE, layer_pattern="M", block_ffn=False, linear_conv_kernel=3, linear_chunk_size=4,
                   mamba_state_dim=8, mamba_head_dim=8, mamba_expand=2, mamba_groups=2, tie_embeddings=True),
}


def _family_cfg(family: str) -> ModelConfig:
    return ModelConfig(**FAMILIES[family])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_native_model_with_non_default_options_exports_exactly(family, tmp_path):
    cfg = _family_cfg(family)
    assert export_family(cfg) == family and export_problem(cfg) is None, export_problem(cfg)
    assert _logits_match(cfg, tmp_path / family, seed=3) <= 1e-5


def test_two_epsilons_qwen3_next_cannot_carry_are_refused_up_front(tmp_path, monkeypatch):
    """Qwen3-Next has one rms_norm_eps; a model whose gated-norm epsilon differs is refused (with
    the fix to make), and the launch note says so before training. Written anyway (the rule
    bypassed), transformers computes other logits: the rule is what keeps exports exact."""
    cfg = _family_cfg("qwen3_next")
    cfg.linear_norm_eps = 1e-6
    want = ("Hugging Face export: Qwen3-Next export: Qwen3-Next has one rms_norm_eps for every norm, the "
            "Gated DeltaNet's gated norm included; set model.linear_norm_eps (1e-06) equal to model.norm_eps (0.3)")
    assert export_problem(cfg) == want
    assert export_note(cfg) == f"ndtrain convert --to-hf will refuse this model: {want}"
    model = build_model(cfg, seed=0)
    with pytest.raises(ValueError, match="set model.linear_norm_eps"):
        save_hf_checkpoint(model, cfg, "/nonexistent/never-written")
    import ndtrain.hf.qwen3_next as q3n
    import ndtrain.hf.rules as rules

    monkeypatch.setattr(rules, "export_problem", lambda cfg: None)
    monkeypatch.setattr(q3n, "_unsupported", lambda cfg: [])
    assert _logits_match(cfg, tmp_path / "bypassed", seed=3) > 1e-3


@pytest.mark.parametrize("over,lost", [
    ({"moe_experts": 4, "moe_bias_update_rate": 0.01}, "model.moe_bias_update_rate = 0.01 (default 0.0)"),
    ({"moe_experts": 4, "moe_capacity_factor": 1.25}, "model.moe_capacity_factor = 1.25 (default 0.0)"),
    ({"rope_partial_factor": 0.5}, "model.rope_partial_factor = 0.5 (default 1.0)"),
])
def test_options_a_family_cannot_express_are_named(over, lost):
    cfg = ModelConfig(**dict(_BASE, **over))
    problem = export_problem(cfg)
    assert problem is not None and problem.startswith("Hugging Face export as ") and lost in problem, problem


def test_unexportable_mixers_are_refused_with_the_rule():
    cfg = ModelConfig(**dict(_BASE, layer_pattern="LA"))
    assert export_problem(cfg) == (
        "Hugging Face export: Hugging Face export covers softmax-attention models with feed-forwards (Llama, "
        "Mixtral, DeepSeek-V3, Qwen3-MoE), Qwen3-Next and all-Mamba-2 mixer-only ones (block_ffn false); "
        "this model's layer_pattern 'LA' uses linear, block_ffn True")
