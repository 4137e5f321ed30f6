"""Hugging Face Mamba-2 (``Mamba2ForCausalLM``) import and export: config.json + safetensors <->
``Transformer`` with ``layer_pattern: M`` and ``block_ffn: false``.

HF's block is ``x + mixer(norm(x))`` with no feed-forward, which is ndtrain's mixer-only block
(``model.block_ffn: false``): ``norm`` -> ``attention_norm``, ``mixer`` -> ``attention`` (the
``ndtrain.model.mamba2.Mamba2`` token mixer). The mixer's parameters map one to one, same shapes
and the same ``in_proj`` row order ``[z (d_inner), x (d_inner), B (g N), C (g N), dt (n_h)]``:
``in_proj``, ``conv1d`` (weight (Ch, 1, W) and bias), ``dt_bias``, ``A_log``, ``D``, ``norm`` (the
gated RMSNorm, grouped by ``n_groups`` -> ``mamba_groups``), ``out_proj``. ``backbone.embeddings``
-> ``tok_embeddings``, ``backbone.norm_f`` -> ``norm``, ``lm_head`` -> ``output``.

Config: ``hidden_size`` -> dim, ``expand`` -> mamba_expand, ``head_dim`` -> mamba_head_dim,
``state_size`` -> mamba_state_dim, ``n_groups`` -> mamba_groups, ``conv_kernel`` ->
linear_conv_kernel, ``chunk_size`` -> linear_chunk_size (speed only), ``layer_norm_epsilon`` ->
norm_eps (all norms). ndtrain's ``n_heads`` (unused by a Mamba-only model but needed by the
config) is HF's ``num_heads`` when that splits ``hidden_size`` into even head dims, else 1;
``max_seq_len`` keeps ndtrain's default (Mamba-2 has no position limit; raise it to train longer).
Fields a config.json omits take ``transformers.Mamba2Config``'s defaults.

Raises ValueError for what ndtrain does not implement: ``use_bias`` (in / out projection biases),
a non-SiLU ``hidden_act``, a ``time_step_limit`` other than (0, inf), a non-integer ``expand``,
``num_heads * head_dim != expand * hidden_size``.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from ndtrain.config import ModelConfig
from ndtrain.hf.common import require, with_family_defaults
from ndtrain.mixer_spec import linear_dims, parse_pattern

_NEEDED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "head_dim", "state_size",
           "expand", "n_groups", "conv_kernel", "layer_norm_epsilon", "tie_word_embeddings")
_MIXER = ("in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight",
          "out_proj.weight")


def config_from_hf_mamba2(hf: dict[str, Any]) -> ModelConfig:
    """``ModelConfig`` from a Mamba-2 config.json dict (omitted fields: ``Mamba2Config``'s
    defaults). Raises ValueError for another model_type or an unsupported feature (module docstring)."""
    if hf.get("model_type") != "mamba2":
        raise ValueError(f"model_type {hf.get('model_type')!r} is not 'mamba2'")
    if isinstance(hf.get("time_step_limit"), (list, tuple)):  # save_pretrained writes inf as {"__float__": ...}
        hf = dict(hf, time_step_limit=tuple(float(v["__float__"]) if isinstance(v, dict) else float(v)
                                            for v in hf["time_step_limit"]))
    hf = with_family_defaults(hf)
    require(hf, _NEEDED)
    if hf.get("use_bias"):
        raise ValueError("use_bias (in_proj / out_proj biases) is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf['hidden_act']!r} is not 'silu'")
    lo, hi = tuple(hf.get("time_step_limit") or (0.0, math.inf))
    if (lo, hi) != (0.0, math.inf):
        raise ValueError(f"time_step_limit {(lo, hi)} is not supported (only (0, inf): no dt clamp)")
    dim, expand = hf["hidden_size"], hf["expand"]
    if float(expand) != int(expand):
        raise ValueError(f"expand {expand} is not an integer")
    nh, p = hf["num_heads"], hf["head_dim"]
    if nh * p != int(expand) * dim:
        raise ValueError(f"num_heads * head_dim ({nh} x {p}) != expand * hidden_size ({int(expand) * dim})")
    n_heads = nh if dim % nh == 0 and (dim // nh) % 2 == 0 else 1
    extra = {"init_std": hf["initializer_range"]} if "initializer_range" in hf else {}
    return ModelConfig(
        name="mamba2", vocab_size=hf["vocab_size"], dim=dim, n_layers=hf["num_hidden_layers"], n_heads=n_heads,
        norm_eps=hf["layer_norm_epsilon"], tie_embeddings=bool(hf["tie_word_embeddings"]), layer_pattern="M",
        block_ffn=False, mamba_expand=int(expand), mamba_head_dim=p, mamba_state_dim=hf["state_size"],
        mamba_groups=hf["n_groups"], linear_conv_kernel=hf["conv_kernel"],
        linear_chunk_size=hf.get("chunk_size") or ModelConfig.linear_chunk_size, **extra)


def is_mamba2(cfg: ModelConfig) -> bool:
    """True for models exported as Mamba-2: every layer mamba2, mixer-only blocks."""
    return set(parse_pattern(cfg.layer_pattern)) == {"mamba2"} and not cfg.block_ffn


def config_to_hf_mamba2(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """A ``Mamba2Config``-compatible dict for ``cfg``. Raises ValueError unless ``is_mamba2(cfg)``
    (a hybrid, or Mamba-2 layers with feed-forwards, is no HF Mamba-2 model)."""
    if not is_mamba2(cfg) or cfg.is_moe or cfg.mtp_depth:
        raise ValueError("Mamba-2 export needs layer_pattern 'M' (every layer mamba2), block_ffn false, "
                         "no MoE and no MTP")
    x = linear_dims(cfg)
    return {
        "architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers, "num_heads": x["m_heads"],
        "head_dim": x["m_head_dim"], "state_size": x["m_state"], "expand": cfg.mamba_expand,
        "n_groups": x["m_groups"], "conv_kernel": x["conv"], "chunk_size": cfg.linear_chunk_size,
        "layer_norm_epsilon": cfg.norm_eps, "use_bias": False, "use_conv_bias": True, "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std,
        "residual_in_fp32": True, "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _name_pairs(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(ndtrain name, HF name) of every weight."""
    pairs = [("tok_embeddings.weight", "backbone.embeddings.weight"), ("norm.weight", "backbone.norm_f.weight"),
             ("output.weight", "lm_head.weight")]
    for i in range(cfg.n_layers):
        pairs.append((f"layers.{i}.attention_norm.weight", f"backbone.layers.{i}.norm.weight"))
        pairs += [(f"layers.{i}.attention.{n}", f"backbone.layers.{i}.mixer.{n}") for n in _MIXER]
    return pairs


def state_dict_from_hf_mamba2(hf_sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename HF Mamba-2 weights to ndtrain names. A tied (or absent) ``lm_head`` is the embedding;
    the older ``backbone.embedding.weight`` name is accepted; without ``use_conv_bias`` the conv
    bias is zero. Raises KeyError listing the missing HF names."""
    hf_sd = dict(hf_sd)
    if "backbone.embeddings.weight" not in hf_sd and "backbone.embedding.weight" in hf_sd:
        hf_sd["backbone.embeddings.weight"] = hf_sd["backbone.embedding.weight"]
    if cfg.tie_embeddings or "lm_head.weight" not in hf_sd:
        hf_sd["lm_head.weight"] = hf_sd.get("backbone.embeddings.weight")
    for i in range(cfg.n_layers):
        w = hf_sd.get(f"backbone.layers.{i}.mixer.conv1d.weight")
        if w is not None:
            hf_sd.setdefault(f"backbone.layers.{i}.mixer.conv1d.bias", torch.zeros(w.shape[0], dtype=w.dtype))
    missing = [h for _, h in _name_pairs(cfg) if hf_sd.get(h) is None]
    if missing:
        raise KeyError(f"HF state dict lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return {n: hf_sd[h] for n, h in _name_pairs(cfg)}


def state_dict_to_hf_mamba2(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """ndtrain weights -> HF Mamba-2 names; a tied head is left out. Raises KeyError for a missing name."""
    return {h: sd[n] for n, h in _name_pairs(cfg) if not (cfg.tie_embeddings and n == "output.weight")}
