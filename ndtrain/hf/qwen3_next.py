"""Hugging Face Qwen3-Next (``Qwen3NextForCausalLM``) import / export: config.json + safetensors.

Qwen3-Next (Qwen team 2025, the ``transformers`` ``modeling_qwen3_next.py``) is a hybrid: Gated
DeltaNet layers (``linear_attn``) and gated softmax attention (``self_attn``) by ``layer_types``
(3:1 in the release), a sparse MoE with a sigmoid-gated shared expert. ndtrain represents it with
model options, all off by default:

* ``layer_pattern`` of G / A letters from ``layer_types``; ``GatedDeltaNet`` has Qwen3-Next's
  parameter names and grouped layout, so its weights copy unchanged; its gated norm uses
  ``rms_norm_eps`` like every other norm, so import sets ``linear_norm_eps`` = ``norm_eps`` and export
  refuses a model whose two epsilons differ (transformers would use ``norm_eps`` for both);
* attention with ``attn_head_dim`` (256 != 2048 / 16 in the release), ``qk_norm``,
  ``attn_output_gate`` and ``rope_partial_factor``: HF's ``q_proj`` (H*2D, C) holds per head
  [query D | gate D]; it is split into ``wq`` and ``wg`` (and joined back on export);
* ``moe_shared_ffn_hidden`` (``shared_expert_intermediate_size``) and ``moe_shared_gate``
  (``shared_expert_gate``); which layers are sparse (``decoder_sparse_step``, ``mlp_only_layers``)
  maps to ``moe_layer_start`` / ``moe_layer_interleave`` where that pattern can express it.

Qwen3-Next's RMSNorms are zero-centred (weight w applied as 1 + w; ``Qwen3NextRMSNorm``) except the
Gated DeltaNet's gated norm: their weights are converted (ndtrain w = 1 + w_hf) rather than the
model changed. Experts are read fused (``experts.gate_up_proj``, transformers 5) or per expert (the
released checkpoints) and written per expert, which transformers 4 and 5 both load. MTP weights
(``mtp.*``) are ignored, as transformers does. Raises ValueError for what either side cannot
express (named), KeyError for a missing weight.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ndtrain.config import ModelConfig
from ndtrain.hf.common import (
    model_from_state_dict,
    read_safetensors,
    require,
    rope_config,
    rope_params,
    unstack_experts,
    with_family_defaults,
)
from ndtrain.hf.moe import _stack_experts
from ndtrain.mixer_spec import layer_mixers, linear_dims
from ndtrain.model import Transformer

_GDN = ("in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "dt_bias", "A_log", "norm.weight",
        "out_proj.weight")  # same names on both sides
_ATTN = {"wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}
_SWIGLU = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_LETTER = {"linear_attention": "G", "full_attention": "A"}


def _pattern(layer_types: list[str]) -> str:
    """The shortest period of ``layer_types`` as G / A letters (the whole list if it has none)."""
    bad = sorted({t for t in layer_types if t not in _LETTER})
    if bad:
        raise ValueError(f"layer_types {bad} are not supported (only linear_attention, full_attention)")
    s, n = "".join(_LETTER[t] for t in layer_types), len(layer_types)
    return next(s[:p] for p in range(1, n + 1) if n % p == 0 and s[:p] * (n // p) == s)


def _moe_span(sparse: list[int], n: int) -> tuple[int, int]:
    """(moe_layer_start, moe_layer_interleave) whose layers are exactly ``sparse`` (sorted, non-empty)."""
    start = sparse[0]
    step = sparse[1] - sparse[0] if len(sparse) > 1 else n
    if list(range(start, n, step)) != sparse:
        raise ValueError(f"sparse (MoE) layers {sparse} are not every k-th layer from one start; ndtrain's "
                         "moe_layer_start / moe_layer_interleave cannot express them")
    return start, step


def config_from_hf_qwen3_next(hf: dict[str, Any]) -> ModelConfig:
    """``ModelConfig`` from a Qwen3-Next config.json dict (missing fields: ``Qwen3NextConfig``'s
    defaults when transformers has it, else ValueError naming them). Raises ValueError for
    biases, a non-SiLU activation, RoPE scaling, other layer types, an unexpressible MoE layout."""
    hf = with_family_defaults(hf)
    require(hf, ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "intermediate_size", "rms_norm_eps", "max_position_embeddings", "head_dim",
                 "linear_num_key_heads", "linear_key_head_dim", "linear_num_value_heads",
                 "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts"))
    if hf.get("attention_bias"):
        raise ValueError("attention_bias is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf['hidden_act']!r} is not 'silu'")
    n, dim, heads = hf["num_hidden_layers"], hf["hidden_size"], hf["num_attention_heads"]
    interval = hf.get("full_attention_interval", 4)
    types = hf.get("layer_types") or ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                      for i in range(n)]
    theta, scaling = rope_params(hf)
    if scaling is not None:
        raise ValueError(f"RoPE scaling {scaling.get('rope_type', scaling.get('type'))!r} is not supported")
    partial = (hf.get("rope_parameters") or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    cfg = ModelConfig(
        name="qwen3_next", vocab_size=hf["vocab_size"], dim=dim, n_layers=n, n_heads=heads,
        n_kv_heads=hf["num_key_value_heads"], ffn_hidden=hf["intermediate_size"], norm_eps=hf["rms_norm_eps"],
        rope_theta=theta, max_seq_len=hf["max_position_embeddings"],
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), init_std=hf.get("initializer_range", 0.02),
        attn_head_dim=0 if hf["head_dim"] == dim // heads else hf["head_dim"], qk_norm=True,
        attn_output_gate=True, rope_partial_factor=float(partial), layer_pattern=_pattern(types),
        linear_heads=hf["linear_num_key_heads"], linear_key_head_dim=hf["linear_key_head_dim"],
        linear_value_heads=hf["linear_num_value_heads"], linear_value_head_dim=hf["linear_value_head_dim"],
        linear_conv_kernel=hf["linear_conv_kernel_dim"], linear_norm_eps=hf["rms_norm_eps"])
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
    sparse = [i for i in range(n) if hf["num_experts"] > 0 and i not in dense and (i + 1) % step == 0]
    if sparse:
        require(hf, ("num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"))
        cfg.moe_layer_start, cfg.moe_layer_interleave = _moe_span(sparse, n)
        cfg.moe_experts, cfg.moe_top_k = hf["num_experts"], hf["num_experts_per_tok"]
        cfg.moe_ffn_hidden, cfg.moe_renormalize = hf["moe_intermediate_size"], bool(hf.get("norm_topk_prob", True))
        cfg.moe_shared_experts, cfg.moe_shared_gate = 1, True
        cfg.moe_shared_ffn_hidden = hf["shared_expert_intermediate_size"]
    return cfg


def _unsupported(cfg: ModelConfig) -> list[str]:
    """What keeps ``cfg`` from being a Qwen3-Next model ([] if nothing)."""
    why = []
    mixers = set(layer_mixers(cfg.layer_pattern, cfg.n_layers))
    if not mixers <= {"attention", "gated_deltanet"}:
        why.append(f"layer_pattern {cfg.layer_pattern!r} uses {sorted(mixers - {'attention', 'gated_deltanet'})}")
    if "attention" in mixers and not (cfg.qk_norm and cfg.attn_output_gate and cfg.attention == "mha"):
        why.append("softmax layers need attention mha with qk_norm and attn_output_gate")
    if "gated_deltanet" in mixers and cfg.linear_norm_eps != cfg.norm_eps:
        why.append(f"Qwen3-Next has one rms_norm_eps for every norm, the Gated DeltaNet's gated norm "
                   f"included; set model.linear_norm_eps ({cfg.linear_norm_eps:g}) equal to model.norm_eps "
                   f"({cfg.norm_eps:g})")
    if cfg.rope_scaling or cfg.mtp_depth:
        why.append("RoPE scaling / MTP are not exported")
    if cfg.is_moe and (cfg.moe_score, cfg.moe_route_scale, cfg.moe_n_groups) != ("softmax", 1.0, 1):
        why.append("routing must be softmax, route scale 1, one group")
    if cfg.is_moe and cfg.moe_shared_experts and not cfg.moe_shared_gate:
        why.append("a shared expert needs moe_shared_gate")
    return why


def config_to_hf_qwen3_next(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """A ``Qwen3NextConfig``-compatible dict (transformers 4 and 5). Raises ValueError naming what
    Qwen3-Next cannot express."""
    why = _unsupported(cfg)
    if why:
        raise ValueError("Qwen3-Next export: " + "; ".join(why))
    x = linear_dims(cfg)
    rope = rope_config(cfg)
    rope["rope_parameters"]["partial_rotary_factor"] = cfg.rope_partial_factor
    kinds = layer_mixers(cfg.layer_pattern, cfg.n_layers)
    return {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        **rope, "partial_rotary_factor": cfg.rope_partial_factor,
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "initializer_range": cfg.init_std,
        "layer_types": ["linear_attention" if k == "gated_deltanet" else "full_attention" for k in kinds],
        "linear_num_key_heads": x["k_heads"], "linear_key_head_dim": x["k_dim"],
        "linear_num_value_heads": x["v_heads"], "linear_value_head_dim": x["v_dim"],
        "linear_conv_kernel_dim": x["conv"], "num_experts": cfg.moe_experts,
        "num_experts_per_tok": cfg.moe_top_k, "moe_intermediate_size": cfg.expert_ffn_dim,
        "shared_expert_intermediate_size": _shared_hidden(cfg), "norm_topk_prob": cfg.moe_renormalize,
        "decoder_sparse_step": 1, "mlp_only_layers": [i for i in range(cfg.n_layers) if not cfg.is_moe_layer(i)],
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _shared_hidden(cfg: ModelConfig) -> int:
    """The shared expert's hidden size (moe_ffn_hidden when there is none: it is exported as zeros)."""
    if not cfg.moe_shared_experts:
        return cfg.expert_ffn_dim
    return cfg.moe_shared_ffn_hidden or cfg.moe_shared_experts * cfg.expert_ffn_dim


def _layer_pairs(cfg: ModelConfig, i: int, kind: str) -> list[tuple[str, str, bool]]:
    """(ndtrain name, HF name, zero-centred norm) of the one-to-one weights of layer ``i``."""
    n, h = f"layers.{i}", f"model.layers.{i}"
    out = [(f"{n}.attention_norm.weight", f"{h}.input_layernorm.weight", True),
           (f"{n}.ffn_norm.weight", f"{h}.post_attention_layernorm.weight", True)]
    if kind == "gated_deltanet":
        out += [(f"{n}.attention.{w}", f"{h}.linear_attn.{w}", False) for w in _GDN]
    else:
        out += [(f"{n}.attention.{a}.weight", f"{h}.self_attn.{b}.weight", False) for a, b in _ATTN.items()]
        out += [(f"{n}.attention.{a}.weight", f"{h}.self_attn.{a}.weight", True) for a in ("q_norm", "k_norm")]
    ff, mlp = f"{n}.feed_forward", f"{h}.mlp"
    if not cfg.is_moe_layer(i):
        return out + [(f"{ff}.{a}.weight", f"{mlp}.{b}.weight", False) for a, b in _SWIGLU.items()]
    out.append((f"{ff}.router.weight", f"{mlp}.gate.weight", False))
    if cfg.moe_shared_experts:
        out += [(f"{ff}.shared.{a}.weight", f"{mlp}.shared_expert.{b}.weight", False) for a, b in _SWIGLU.items()]
        out.append((f"{ff}.shared_gate.weight", f"{mlp}.shared_expert_gate.weight", False))
    return out


def _top_pairs(cfg: ModelConfig) -> list[tuple[str, str, bool]]:
    out = [("tok_embeddings.weight", "model.embed_tokens.weight", False), ("norm.weight", "model.norm.weight", True)]
    return out if cfg.tie_embeddings else out + [("output.weight", "lm_head.weight", False)]


def state_dict_from_hf_qwen3_next(hf_sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF Qwen3-Next weights -> ndtrain names (parameters and ``expert_bias`` buffers, zeros).
    Raises KeyError naming a missing HF weight."""
    def get(key: str) -> torch.Tensor:
        if key not in hf_sd:
            raise KeyError(f"HF state dict lacks {key}")
        return hf_sd[key]

    kinds = layer_mixers(cfg.layer_pattern, cfg.n_layers)
    out = {}
    for i, kind in enumerate(kinds):
        for n_name, h_name, centred in _layer_pairs(cfg, i, kind):
            out[n_name] = get(h_name) + 1 if centred else get(h_name)
        h, n, d = f"model.layers.{i}", f"layers.{i}", cfg.head_dim
        if kind == "attention":  # q_proj rows per head: [query D | gate D]
            q = get(f"{h}.self_attn.q_proj.weight").view(cfg.n_heads, 2 * d, -1)
            out[f"{n}.attention.wq.weight"] = q[:, :d].reshape(cfg.n_heads * d, -1)
            out[f"{n}.attention.wg.weight"] = q[:, d:].reshape(cfg.n_heads * d, -1)
        if cfg.is_moe_layer(i):
            ff, moe, f = f"{n}.feed_forward", f"{h}.mlp", cfg.expert_ffn_dim
            out[f"{ff}.expert_bias"] = torch.zeros(cfg.moe_experts)
            if f"{moe}.experts.gate_up_proj" in hf_sd:  # transformers 5's fused layout (E, 2F, C)
                gate_up = hf_sd[f"{moe}.experts.gate_up_proj"]
                out[f"{ff}.experts.w1"], out[f"{ff}.experts.w3"] = gate_up[:, :f], gate_up[:, f:]
                out[f"{ff}.experts.w2"] = get(f"{moe}.experts.down_proj")
            else:
                for a, b in _SWIGLU.items():
                    out[f"{ff}.experts.{a}"] = _stack_experts(hf_sd, moe, cfg.moe_experts, b)
    for n_name, h_name, centred in _top_pairs(cfg):
        out[n_name] = get(h_name) + 1 if centred else get(h_name)
    if cfg.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def state_dict_to_hf_qwen3_next(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """ndtrain weights -> HF Qwen3-Next names: zero-centred norms as w - 1, ``wq`` / ``wg`` joined
    into ``q_proj``, experts per expert; a model without a shared expert gets a zero one (its output
    is exactly 0). Raises ValueError (see ``config_to_hf_qwen3_next``) or KeyError."""
    why = _unsupported(cfg)
    if why:
        raise ValueError("Qwen3-Next export: " + "; ".join(why))
    out = {}
    for i, kind in enumerate(layer_mixers(cfg.layer_pattern, cfg.n_layers)):
        for n_name, h_name, centred in _layer_pairs(cfg, i, kind):
            out[h_name] = sd[n_name] - 1 if centred else sd[n_name]
        h, n, d = f"model.layers.{i}", f"layers.{i}", cfg.head_dim
        if kind == "attention":
            q = sd[f"{n}.attention.wq.weight"].view(cfg.n_heads, d, -1)
            g = sd[f"{n}.attention.wg.weight"].view(cfg.n_heads, d, -1)
            out[f"{h}.self_attn.q_proj.weight"] = torch.cat([q, g], dim=1).reshape(2 * cfg.n_heads * d, -1)
        if cfg.is_moe_layer(i):
            ff, moe = f"{n}.feed_forward", f"{h}.mlp"
            if sd[f"{ff}.expert_bias"].any():
                raise ValueError(f"{ff}.expert_bias is non-zero; Qwen3-Next has no selection bias")
            unstack_experts(out, sd, ff, moe, _SWIGLU, cfg.moe_experts)
            if not cfg.moe_shared_experts:
                w, f = sd[f"{ff}.router.weight"], cfg.expert_ffn_dim
                for b, shape in (("gate_proj", (f, cfg.dim)), ("up_proj", (f, cfg.dim)), ("down_proj", (cfg.dim, f))):
                    out[f"{moe}.shared_expert.{b}.weight"] = w.new_zeros(shape)
                out[f"{moe}.shared_expert_gate.weight"] = w.new_zeros(1, cfg.dim)
    for n_name, h_name, centred in _top_pairs(cfg):
        out[h_name] = sd[n_name] - 1 if centred else sd[n_name]
    return out


def is_qwen3_next_exportable(cfg: ModelConfig) -> bool:
    """True for models ``save_hf_checkpoint`` writes as Qwen3-Next: Gated DeltaNet layers, or the
    Qwen3-Next attention options (still rejected with ValueError when something else differs)."""
    return "gated_deltanet" in layer_mixers(cfg.layer_pattern, cfg.n_layers) or cfg.attn_output_gate


def load_hf_qwen3_next_checkpoint(folder: str | Path, device: torch.device | str = "cpu",
                                  dtype: torch.dtype = torch.float32) -> tuple[ModelConfig, Transformer]:
    """Read a Qwen3-Next folder into a ``Transformer`` with ``dtype`` parameters on ``device``.
    Raises FileNotFoundError, ValueError (unsupported config) or KeyError (missing weights)."""
    folder = Path(folder)
    cfg = config_from_hf_qwen3_next(json.loads((folder / "config.json").read_text()))
    sd = state_dict_from_hf_qwen3_next(read_safetensors(folder), cfg)
    return cfg, model_from_state_dict(cfg, sd, device, dtype)
