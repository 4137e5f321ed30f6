"""Hugging Face Llama (``LlamaForCausalLM``) checkpoint import / export: config.json + safetensors.

Weights map one to one by name (table ``_LAYER_MAP``). Both sides use the rotate-half RoPE layout
(see ``ndtrain.model.rope``), so q / k projections are copied without permutation. Config export
writes both the transformers 4 keys (``rope_theta``, ``rope_scaling``) and the transformers 5 key
(``rope_parameters``); import accepts either. Llama 3.1 RoPE scaling maps to ``rope_type: llama3``.
Fields a config.json omits take ``transformers.LlamaConfig``'s defaults (``hf_common.with_family_defaults``;
without transformers a missing numeric field raises ValueError). Mixtral / DeepSeek-V3 folders are
imported by ``ndtrain.hf_moe`` and MoE / MLA models exported by ``ndtrain.hf_moe_export``;
Qwen3-MoE by ``ndtrain.hf_qwen3_moe``, Mamba-2 by ``ndtrain.hf_mamba2`` (both ways, by model_type /
model options).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ndtrain.config import ModelConfig
from ndtrain.hf_common import (
    DEFAULT_SHARD_BYTES,
    model_from_state_dict,
    read_safetensors,
    require,
    rope_config,
    rope_params,
    with_family_defaults,
    write_hf_folder,
)
from ndtrain.hf_mamba2 import (
    config_from_hf_mamba2,
    config_to_hf_mamba2,
    is_mamba2,
    state_dict_from_hf_mamba2,
    state_dict_to_hf_mamba2,
)
from ndtrain.hf_moe import load_hf_moe_checkpoint
from ndtrain.hf_moe_export import config_to_hf_moe, is_hf_moe_exportable, state_dict_to_hf_moe
from ndtrain.hf_qwen3_moe import (
    config_from_hf_qwen3_moe,
    config_to_hf_qwen3_moe,
    is_qwen3_moe,
    state_dict_from_hf_qwen3_moe,
    state_dict_to_hf_qwen3_moe,
)
from ndtrain.hf_qwen3_next import (
    config_from_hf_qwen3_next,
    config_to_hf_qwen3_next,
    is_qwen3_next_exportable,
    state_dict_from_hf_qwen3_next,
    state_dict_to_hf_qwen3_next,
)
from ndtrain.model import Transformer

# model_type -> (config.json dict -> ModelConfig, (HF state dict, cfg) -> ndtrain state dict)
_IMPORTERS = {"qwen3_moe": (config_from_hf_qwen3_moe, state_dict_from_hf_qwen3_moe),
              "mamba2": (config_from_hf_mamba2, state_dict_from_hf_mamba2),
              "qwen3_next": (config_from_hf_qwen3_next, state_dict_from_hf_qwen3_next)}

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


def load_hf_checkpoint(folder: str | Path, device: torch.device | str = "cpu",
                       dtype: torch.dtype = torch.float32) -> tuple[ModelConfig, Transformer]:
    """Read config.json and (possibly sharded) safetensors from ``folder`` into a ``Transformer``.
    Mixtral and DeepSeek-V3 checkpoints are delegated to ``ndtrain.hf_moe``.

    Returns (cfg, model) with parameters in ``dtype`` on ``device``.
    Raises FileNotFoundError, ValueError (unsupported config) or KeyError (missing weights).
    """
    folder = Path(folder)
    hf = json.loads((folder / "config.json").read_text())
    if hf.get("model_type") in ("mixtral", "deepseek_v3"):  # MoE families: ndtrain.hf_moe
        return load_hf_moe_checkpoint(folder, device, dtype)
    to_cfg, to_sd = _IMPORTERS.get(hf.get("model_type"), (config_from_hf, state_dict_from_hf))
    cfg = to_cfg(hf)
    return cfg, model_from_state_dict(cfg, to_sd(read_safetensors(folder), cfg), device, dtype)


def save_hf_checkpoint(model: Transformer, cfg: ModelConfig, folder: str | Path, tokenizer=None,
                       max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
    """Write a ``save_pretrained``-style folder loadable by ``AutoModelForCausalLM.from_pretrained``:
    safetensors (sharded past ``max_shard_bytes``), ``config.json``, ``generation_config.json`` and,
    given an ndtrain ``tokenizer``, its files for ``AutoTokenizer.from_pretrained`` (and its EOS id
    in both configs). Llama for a dense MHA / GQA model, Mixtral / DeepSeek-V3 for an MoE / MLA one
    (``ndtrain.hf_moe_export``), Qwen3-MoE for a ``qk_norm`` one (``ndtrain.hf_qwen3_moe``), Mamba-2
    for an all-``M`` mixer-only one (``ndtrain.hf_mamba2``), Qwen3-Next for Gated DeltaNet / gated
    attention (``ndtrain.hf_qwen3_next``); ValueError if it fits none of them (e.g.
    a hybrid ``model.layer_pattern``, or mixer-only blocks with other mixers)."""
    from ndtrain.mixer_spec import non_softmax_mixers

    sd = model.state_dict()
    dtype = next(iter(sd.values())).dtype
    others = non_softmax_mixers(cfg)
    if is_mamba2(cfg):  # ndtrain.hf_mamba2
        hf_sd, hf_cfg = state_dict_to_hf_mamba2(sd, cfg), config_to_hf_mamba2(cfg, dtype)
    elif is_qwen3_next_exportable(cfg):  # Gated DeltaNet / gated attention: ndtrain.hf_qwen3_next
        hf_sd, hf_cfg = state_dict_to_hf_qwen3_next(sd, cfg), config_to_hf_qwen3_next(cfg, dtype)
    elif others or not cfg.block_ffn:
        raise ValueError(f"Hugging Face export covers softmax-attention models with feed-forwards (Llama, "
                         f"Mixtral, DeepSeek-V3, Qwen3-MoE), Qwen3-Next and all-Mamba-2 mixer-only ones "
                         f"(block_ffn false); this model's layer_pattern {cfg.layer_pattern!r} uses "
                         f"{', '.join(others) or 'attention'}, block_ffn {cfg.block_ffn}")
    elif is_qwen3_moe(cfg):  # QK-norm attention: ndtrain.hf_qwen3_moe
        hf_sd, hf_cfg = state_dict_to_hf_qwen3_moe(sd, cfg), config_to_hf_qwen3_moe(cfg, dtype)
    elif is_hf_moe_exportable(cfg):
        hf_sd, hf_cfg = state_dict_to_hf_moe(sd, cfg), config_to_hf_moe(cfg, dtype)
    else:
        hf_sd, hf_cfg = state_dict_to_hf(sd, cfg), config_to_hf(cfg, dtype)
    eos = None
    if tokenizer is not None:
        from ndtrain.data.tokenizer import save_tokenizer_files

        save_tokenizer_files(tokenizer, folder, cfg.max_seq_len)
        eos = tokenizer.eos_id
    write_hf_folder(folder, hf_sd, hf_cfg, max_shard_bytes, eos)
