"""Hugging Face Llama (``LlamaForCausalLM``) import / export: config.json dict and state dict.

Weights map one to one by name (table ``_LAYER_MAP``). Both sides use the rotate-half RoPE layout
(see ``ndtrain.model.rope``), so q / k projections are copied without permutation. Config export
writes both the transformers 4 keys (``rope_theta``, ``rope_scaling``) and the transformers 5 key
(``rope_parameters``); import accepts either. Llama 3.1 RoPE scaling maps to ``rope_type: llama3``.
Fields a config.json omits take ``transformers.LlamaConfig``'s defaults (``hf_common.with_family_defaults``;
without transformers a missing numeric field raises ValueError). The folder reader / writer that picks
the family is ``ndtrain.hf.folder``.
"""
from __future__ import annotations

from typing import Any

import torch

from ndtrain.config import ModelConfig
from ndtrain.hf.common import (
    require,
    rope_config,
    rope_params,
    with_family_defaults,
)

# ndtrain block-relative name -> HF name within "model.layers.{i}."
_LAYER_MAP = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_MAP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight"}


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """``ModelConfig`` from a Llama config.json dict; omitted fields take ``transformers.LlamaConfig``'s
    defaults (without transformers a missing numeric field raises ValueError).

    Raises ValueError for features this model does not implement (biases, a non-SiLU activation,
    a head_dim other than hidden_size / num_attention_heads, RoPE scaling other than llama3).
    """
    if hf.get("model_type", "llama") != "llama":
        raise ValueError(f"model_type {hf.get('model_type')!r} is not 'llama'")
    hf = with_family_defaults(hf)
    require(hf, ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                 "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings"))
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError("attention / MLP biases are not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf['hidden_act']!r} is not 'silu'")
    dim, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, dim // n_heads):
        raise ValueError(f"head_dim {hf['head_dim']} != hidden_size / num_attention_heads ({dim // n_heads})")
    theta, scaling = rope_params(hf)
    cfg = ModelConfig(
        name="llama", vocab_size=hf["vocab_size"], dim=dim, n_layers=hf["num_hidden_layers"], n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads, ffn_hidden=hf["intermediate_size"],
        norm_eps=hf["rms_norm_eps"], rope_theta=theta, max_seq_len=hf["max_position_embeddings"],
        tie_embeddings=bool(hf["tie_word_embeddings"]), init_std=hf.get("initializer_range", 0.02))
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "llama3":
            raise ValueError(f"rope scaling type {kind!r} is not supported (only 'llama3')")
        cfg.rope_scaling = True
        cfg.rope_scaling_factor = float(scaling["factor"])
        cfg.rope_low_freq_factor = float(scaling["low_freq_factor"])
        cfg.rope_high_freq_factor = float(scaling["high_freq_factor"])
        cfg.rope_original_max_seq_len = int(scaling["original_max_position_embeddings"])
    return cfg


def config_to_hf(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """A ``LlamaConfig``-compatible dict (transformers 4 and 5) for ``cfg``."""
    scaling = None
    if cfg.rope_scaling:
        scaling = {"rope_type": "llama3", "factor": cfg.rope_scaling_factor,
                   "low_freq_factor": cfg.rope_low_freq_factor, "high_freq_factor": cfg.rope_high_freq_factor,
                   "original_max_position_embeddings": cfg.rope_original_max_seq_len}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        **rope_config(cfg, scaling),
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "mlp_bias": False,
        "initializer_range": cfg.init_std, "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _name_pairs(cfg: ModelConfig) -> list[tuple[str, str]]:
    pairs = [(k, v) for k, v in _TOP_MAP.items()]
    for i in range(cfg.n_layers):
        pairs += [(f"layers.{i}.{k}", f"model.layers.{i}.{v}") for k, v in _LAYER_MAP.items()]
    return pairs


def state_dict_from_hf(hf_sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename HF weights to ndtrain names. With tied embeddings ``output.weight`` is the embedding
    (``lm_head.weight`` may be absent). Extra HF keys (e.g. ``rotary_emb.inv_freq``) are ignored.

    Raises KeyError listing the missing HF names.
    """
    if cfg.tie_embeddings:
        hf_sd = dict(hf_sd, **{"lm_head.weight": hf_sd.get("model.embed_tokens.weight")})
    missing = [h for _, h in _name_pairs(cfg) if hf_sd.get(h) is None]
    if missing:
        raise KeyError(f"HF state dict lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return {n: hf_sd[h] for n, h in _name_pairs(cfg)}


def state_dict_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename ndtrain weights to HF names; a tied output head is left out (as ``save_pretrained``
    does). Raises KeyError for a missing ndtrain name."""
    return {h: sd[n] for n, h in _name_pairs(cfg) if not (cfg.tie_embeddings and n == "output.weight")}
