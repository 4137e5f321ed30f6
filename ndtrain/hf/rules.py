"""Which Hugging Face family a model exports as, and every option it would lose: decided from the
``ModelConfig`` alone, so ``ndtrain train`` can say before training whether ``ndtrain convert
--to-hf`` will work (``export_problem``) and the exporter refuses a model that transformers would
compute differently instead of writing it.

The whole-kind rule: a family's config.json expresses a fixed set of ``ModelConfig`` fields
(``_EXPRESSED``). Any other field that changes the forward pass (``_active_fields``: only the fields
the model's options switch on, e.g. ``mla_*`` under MLA) must hold its default, else the export is
refused naming it: transformers would silently use its own value (a different epsilon, RoPE
variant, gate...). Fields that only shape training (loss weights, init, chunk size) never matter.
Beyond that, each family module states its own structural rules (``config_to_hf*`` raise
ValueError).
"""
from __future__ import annotations

from dataclasses import fields

from ndtrain.config import ModelConfig
from ndtrain.hf.llama import config_to_hf, state_dict_to_hf
from ndtrain.hf.mamba2 import config_to_hf_mamba2, is_mamba2, state_dict_to_hf_mamba2
from ndtrain.hf.moe import _family, config_to_hf_moe, is_hf_moe_exportable, state_dict_to_hf_moe
from ndtrain.hf.qwen3_moe import config_to_hf_qwen3_moe, is_qwen3_moe, state_dict_to_hf_qwen3_moe
from ndtrain.hf.qwen3_next import config_to_hf_qwen3_next, is_qwen3_next_exportable, state_dict_to_hf_qwen3_next
from ndtrain.mixer_spec import non_softmax_mixers, parse_pattern

__all__ = ["EXPORTERS", "export_family", "export_note", "export_problem", "unexpressed_fields"]

# family -> ((ModelConfig, dtype) -> config.json dict, (state dict, ModelConfig) -> HF state dict)
EXPORTERS = {"llama": (config_to_hf, state_dict_to_hf), "mixtral": (config_to_hf_moe, state_dict_to_hf_moe),
             "deepseek_v3": (config_to_hf_moe, state_dict_to_hf_moe),
             "qwen3_moe": (config_to_hf_qwen3_moe, state_dict_to_hf_qwen3_moe),
             "qwen3_next": (config_to_hf_qwen3_next, state_dict_to_hf_qwen3_next),
             "mamba2": (config_to_hf_mamba2, state_dict_to_hf_mamba2)}
_SIZES = {"vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "multiple_of",
          "ffn_dim_multiplier", "max_seq_len", "tie_embeddings", "attn_head_dim", "norm_eps", "rope_theta"}
_ROPE_SCALING = {"rope_scaling", "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                 "rope_original_max_seq_len"}
_MOE_BASE = {"moe_experts", "moe_top_k", "moe_ffn_hidden", "moe_score", "moe_renormalize"}
_EXPRESSED = {
    "llama": _SIZES | _ROPE_SCALING,
    "mixtral": _SIZES | _MOE_BASE,
    "deepseek_v3": _SIZES | _MOE_BASE | {"moe_shared_experts", "moe_route_scale", "moe_n_groups", "moe_topk_groups",
                                         "moe_layer_start", "moe_bias_update_rate", "attention", "mla_q_rank",
                                         "mla_kv_rank", "mla_rope_dim", "mla_nope_dim", "mla_v_dim", "mtp_depth"},
    "qwen3_moe": _SIZES | _MOE_BASE | {"qk_norm", "moe_layer_start", "moe_layer_interleave"},
    "qwen3_next": _SIZES | _MOE_BASE | {"qk_norm", "attn_output_gate", "rope_partial_factor", "layer_pattern",
                                        "moe_shared_experts", "moe_shared_ffn_hidden", "moe_shared_gate",
                                        "moe_layer_start", "moe_layer_interleave", "linear_heads",
                                        "linear_key_head_dim", "linear_value_heads", "linear_value_head_dim",
                                        "linear_conv_kernel", "linear_norm_eps"},
    "mamba2": (_SIZES - {"n_heads", "n_kv_heads", "ffn_hidden", "attn_head_dim", "rope_theta"})
    | {"layer_pattern", "block_ffn", "linear_conv_kernel", "mamba_state_dim", "mamba_head_dim", "mamba_expand",
       "mamba_groups"},
}


def _active_fields(cfg: ModelConfig) -> set[str]:
    """The fields that change this model's forward pass (its options switch groups on)."""
    out = _SIZES | {"qk_norm", "block_ffn", "attn_output_gate", "rope_partial_factor", "layer_pattern",
                    "attention", "mtp_depth", "rope_scaling"}
    mixers = set(parse_pattern(cfg.layer_pattern))
    if "mamba2" in mixers and len(mixers) == 1:
        out -= {"n_heads", "n_kv_heads", "attn_head_dim", "rope_theta", "qk_norm", "attn_output_gate",
                "rope_partial_factor", "attention"}
    if not cfg.block_ffn:
        out -= {"ffn_hidden", "multiple_of", "ffn_dim_multiplier"}
    if cfg.rope_scaling:
        out |= _ROPE_SCALING
    if cfg.attention == "mla":
        out |= {"mla_q_rank", "mla_kv_rank", "mla_rope_dim", "mla_nope_dim", "mla_v_dim"}
    if cfg.is_moe:
        out |= _MOE_BASE | {"moe_shared_experts", "moe_shared_ffn_hidden", "moe_shared_gate", "moe_route_scale",
                            "moe_n_groups", "moe_topk_groups", "moe_layer_start", "moe_layer_interleave",
                            "moe_bias_update_rate", "moe_capacity_factor", "moe_max_nodes"}
    if "gated_deltanet" in mixers:
        out |= {"linear_heads", "linear_key_head_dim", "linear_value_heads", "linear_value_head_dim",
                "linear_conv_kernel", "linear_norm_eps"}
    if "mamba2" in mixers:
        out |= {"linear_conv_kernel", "mamba_state_dim", "mamba_head_dim", "mamba_expand", "mamba_groups"}
    return out


def unexpressed_fields(cfg: ModelConfig, family: str) -> list[str]:
    """``model.<field> = value (default d)`` for each active field off its default that ``family``'s
    config.json cannot carry, in schema order ([] when none)."""
    default = ModelConfig()
    lost = _active_fields(cfg) - _EXPRESSED[family]
    return [f"model.{f.name} = {getattr(cfg, f.name)!r} (default {getattr(default, f.name)!r})"
            for f in fields(ModelConfig) if f.name in lost and getattr(cfg, f.name) != getattr(default, f.name)]


def export_family(cfg: ModelConfig) -> str:
    """The family ``save_hf_checkpoint`` writes ``cfg`` as: llama | mixtral | deepseek_v3 | qwen3_moe
    | qwen3_next | mamba2. Raises ValueError when none fits (the message names why)."""
    others = non_softmax_mixers(cfg)
    if is_mamba2(cfg):
        return "mamba2"
    if is_qwen3_next_exportable(cfg):
        return "qwen3_next"
    if others or not cfg.block_ffn:
        raise ValueError(f"Hugging Face export covers softmax-attention models with feed-forwards (Llama, "
                         f"Mixtral, DeepSeek-V3, Qwen3-MoE), Qwen3-Next and all-Mamba-2 mixer-only ones "
                         f"(block_ffn false); this model's layer_pattern {cfg.layer_pattern!r} uses "
                         f"{', '.join(others) or 'attention'}, block_ffn {cfg.block_ffn}")
    if is_qwen3_moe(cfg):
        return "qwen3_moe"
    if is_hf_moe_exportable(cfg):
        return _family(cfg)
    return "llama"


def export_problem(cfg: ModelConfig) -> str | None:
    """None when ``ndtrain convert --to-hf`` can write ``cfg`` as a Hugging Face model that computes
    what ndtrain computes; else the reason in one line (``Hugging Face export: ...``). Pure config:
    call it before training."""
    import warnings

    try:
        family = export_family(cfg)
        with warnings.catch_warnings():  # e.g. "MTP modules are not exported": said again at export
            warnings.simplefilter("ignore")
            EXPORTERS[family][0](cfg)
    except ValueError as e:
        return f"Hugging Face export: {str(e).splitlines()[0]}"
    lost = unexpressed_fields(cfg, family)
    if lost:
        return f"Hugging Face export as {family}: its config.json cannot express {'; '.join(lost)}"
    return None


def export_note(cfg: ModelConfig) -> str | None:
    """The one line ``ndtrain train`` prints at launch when this model will not export (None when it
    will): training it is fine, only ``ndtrain convert --to-hf`` refuses it afterwards."""
    problem = export_problem(cfg)
    return None if problem is None else f"ndtrain convert --to-hf will refuse this model: {problem}"
