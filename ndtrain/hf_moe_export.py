"""Hugging Face MoE export: ndtrain ``Transformer`` -> Mixtral (``MixtralForCausalLM``) or DeepSeek-V3
(``DeepseekV3ForCausalLM``) config dict + state dict, the inverse of ``ndtrain.hf_moe``.

``ndtrain.hf.save_hf_checkpoint`` dispatches here for MoE / MLA models (``is_hf_moe_exportable``).
Which family: MLA attention -> DeepSeek-V3; otherwise Mixtral. Experts are written per expert in
the checkpoint layout of the released models (Mixtral ``block_sparse_moe.experts.{j}.w1/w3/w2``,
DeepSeek ``mlp.experts.{j}.gate_proj/up_proj/down_proj``), which transformers 4 and 5 both load.
DeepSeek's RoPE rows are written back interleaved (``rope_interleave: true``), so an imported
checkpoint is re-exported with the original tensors; ``expert_bias`` -> ``e_score_correction_bias``.

Raises ValueError for what the target family cannot express (its routing, a layer pattern other
than its own, RoPE scaling, a non-zero Mixtral ``expert_bias``). MTP modules (``mtp_depth > 0``)
are not exported (transformers has no MTP): ``num_nextn_predict_layers`` is written as 0.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch

from ndtrain.config import ModelConfig
from ndtrain.hf_common import export_frame, rope_config, unstack_experts
from ndtrain.hf_moe import _deinterleave

_ATTN = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}
_MLA = {"wq": "q_proj", "wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj",
        "wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj"}
_DENSE = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def is_hf_moe_exportable(cfg: ModelConfig) -> bool:
    """True for models this module exports (MoE or MLA); they may still be rejected by
    ``config_to_hf_moe`` with ValueError."""
    return cfg.is_moe or cfg.attention == "mla"


def _family(cfg: ModelConfig) -> str:
    """'mixtral' or 'deepseek_v3'; ValueError if ``cfg`` fits neither."""
    if not cfg.is_moe or cfg.moe_layer_interleave != 1 or cfg.rope_scaling:
        raise ValueError("HF MoE export needs an MoE model with moe_layer_interleave 1 and no RoPE scaling")
    if cfg.attention == "mla":
        if cfg.moe_score != "sigmoid" or cfg.moe_shared_experts < 1:
            raise ValueError("DeepSeek-V3 export needs moe_score 'sigmoid' and moe_shared_experts >= 1")
        return "deepseek_v3"
    if (cfg.moe_score, cfg.moe_renormalize, cfg.moe_route_scale, cfg.moe_n_groups, cfg.moe_shared_experts,
            cfg.moe_layer_start) != ("softmax", True, 1.0, 1, 0, 0):
        raise ValueError("Mixtral export needs softmax routing renormalised over top-k, route scale 1, "
                         "one group, no shared experts and every layer MoE")
    return "mixtral"


def config_to_hf_moe(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """A ``MixtralConfig`` or ``DeepseekV3Config``-compatible dict (transformers 4 and 5) for ``cfg``.
    Raises ValueError (see ``_family``)."""
    kind = _family(cfg)
    if cfg.mtp_depth:  # the exported model is still usable; its MTP heads are not part of it
        warnings.warn(f"mtp_depth={cfg.mtp_depth}: MTP modules are not exported (transformers has no MTP)",
                      stacklevel=2)
    out: dict[str, Any] = {
        "model_type": kind, "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, **rope_config(cfg),
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "initializer_range": cfg.init_std,
        "num_experts_per_tok": cfg.moe_top_k, "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if kind == "mixtral":
        return dict(out, architectures=["MixtralForCausalLM"], intermediate_size=cfg.expert_ffn_dim,
                    num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim, sliding_window=None,
                    num_local_experts=cfg.moe_experts)
    return dict(
        out, architectures=["DeepseekV3ForCausalLM"], intermediate_size=cfg.ffn_dim,
        moe_intermediate_size=cfg.expert_ffn_dim, num_key_value_heads=cfg.n_heads,
        n_routed_experts=cfg.moe_experts, n_shared_experts=cfg.moe_shared_experts,
        routed_scaling_factor=cfg.moe_route_scale, norm_topk_prob=cfg.moe_renormalize,
        n_group=cfg.moe_n_groups, topk_group=cfg.moe_topk_groups, first_k_dense_replace=cfg.moe_layer_start,
        q_lora_rank=cfg.mla_q_rank or None, kv_lora_rank=cfg.mla_kv_rank, qk_rope_head_dim=cfg.mla_rope_dim,
        qk_nope_head_dim=cfg.mla_nope_dim or cfg.head_dim, v_head_dim=cfg.mla_v_dim or cfg.head_dim,
        head_dim=cfg.mla_rope_dim, rope_interleave=True, num_nextn_predict_layers=0)


def _moe_layer(sd: dict[str, torch.Tensor], cfg: ModelConfig, ff: str, hp: str, kind: str) -> dict:
    """HF tensors of one MoE feed-forward (ndtrain prefix ``ff``, HF layer prefix ``hp``)."""
    out = {}
    if kind == "mixtral":
        moe, names = f"{hp}.block_sparse_moe", {"w1": "w1", "w3": "w3", "w2": "w2"}
        if sd[f"{ff}.expert_bias"].any():
            raise ValueError(f"{ff}.expert_bias is non-zero; Mixtral has no selection bias")
    else:
        moe, names = f"{hp}.mlp", _DENSE
        out[f"{moe}.gate.e_score_correction_bias"] = sd[f"{ff}.expert_bias"]
        for n_name, h_name in _DENSE.items():
            out[f"{moe}.shared_experts.{h_name}.weight"] = sd[f"{ff}.shared.{n_name}.weight"]
    out[f"{moe}.gate.weight"] = sd[f"{ff}.router.weight"]
    unstack_experts(out, sd, ff, moe, names, cfg.moe_experts)
    return out


def _attention(sd: dict[str, torch.Tensor], cfg: ModelConfig, npf: str, hp: str) -> dict:
    """HF attention tensors of one block; MLA RoPE rows re-interleaved."""
    mla = cfg.attention == "mla"
    out = {f"{hp}.self_attn.{h}.weight": sd[f"{npf}.attention.{n}.weight"]
           for n, h in (_MLA if mla else _ATTN).items() if f"{npf}.attention.{n}.weight" in sd}
    if mla:
        qk = (cfg.mla_nope_dim or cfg.head_dim) + cfg.mla_rope_dim
        q_key = f"{hp}.self_attn.{'q_b_proj' if cfg.mla_q_rank else 'q_proj'}.weight"
        out[q_key] = _deinterleave(out[q_key], qk - cfg.mla_rope_dim, cfg.mla_rope_dim, qk, inverse=True)
        kv_key = f"{hp}.self_attn.kv_a_proj_with_mqa.weight"
        out[kv_key] = _deinterleave(out[kv_key], cfg.mla_kv_rank, cfg.mla_rope_dim, out[kv_key].shape[0],
                                    inverse=True)
    return out


def state_dict_to_hf_moe(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename / unstack ndtrain weights (and ``expert_bias`` buffers) to HF Mixtral or DeepSeek-V3
    names; a tied output head is left out; MTP weights are dropped. Raises ValueError (see
    ``_family``) or KeyError for a missing ndtrain name."""
    kind = _family(cfg)
    out = export_frame(sd, cfg)
    for i in range(cfg.n_layers):
        hp, npf = f"model.layers.{i}", f"layers.{i}"
        out.update(_attention(sd, cfg, npf, hp))
        if cfg.is_moe_layer(i):
            out.update(_moe_layer(sd, cfg, f"{npf}.feed_forward", hp, kind))
        else:
            for n_name, h_name in _DENSE.items():
                out[f"{hp}.mlp.{h_name}.weight"] = sd[f"{npf}.feed_forward.{n_name}.weight"]
    return out
