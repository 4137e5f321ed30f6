"""Hugging Face Qwen3-MoE (``Qwen3MoeForCausalLM``) import and export: config.json + safetensors
<-> ``Transformer``.

Qwen3-MoE ("Qwen3 Technical Report", Qwen team 2025; transformers' ``modeling_qwen3_moe``) is a
Llama-style decoder with three differences this module maps onto ``ModelConfig`` options:

* QK-norm: an RMSNorm (gain of ``head_dim``, eps ``rms_norm_eps``) on every q / k head before RoPE
  -> ``model.qk_norm`` (``self_attn.q_norm`` / ``k_norm`` <-> ``attention.q_norm`` / ``k_norm``).
* ``head_dim`` independent of ``hidden_size / num_attention_heads`` (128 at 2048 / 32 in
  Qwen3-30B-A3B) -> ``model.attn_head_dim``.
* Routing: softmax over all experts, top-k, renormalised only if ``norm_topk_prob``, no shared
  expert -> ``moe_score: softmax``, ``moe_renormalize = norm_topk_prob``. Layer i is MoE when
  ``i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0`` -> ``moe_layer_start`` /
  ``moe_layer_interleave`` (a set of MoE layers those two cannot express raises ValueError);
  ``intermediate_size`` is the dense layers' SwiGLU width, ``moe_intermediate_size`` an expert's.

Experts are written per expert (``mlp.experts.{j}.gate_proj/up_proj/down_proj.weight``), the
layout of the released checkpoints and of transformers 5's ``save_pretrained``; import also takes
the fused ``mlp.experts.gate_up_proj`` (E, 2F, C) / ``down_proj`` (E, C, F). Fields a config.json
omits take ``transformers.Qwen3MoeConfig``'s defaults (``hf_common.with_family_defaults``).
Not mapped: ``router_aux_loss_coef`` (a training setting: set ``model.moe_aux_loss_coef``).
Raises ValueError for what ndtrain does not implement: biases, non-SiLU, sliding window, RoPE scaling.
"""
from __future__ import annotations

from typing import Any

import torch

from ndtrain.config import ModelConfig
from ndtrain.hf.common import export_frame, require, rope_config, unstack_experts, with_family_defaults
from ndtrain.hf.moe import _common, state_dict_from_hf_moe

_NEEDED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
           "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "intermediate_size",
           "moe_intermediate_size", "num_experts_per_tok", "norm_topk_prob", "decoder_sparse_step")
_ATTN = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj", "q_norm": "q_norm", "k_norm": "k_norm"}
_SWIGLU = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _moe_layers(hf: dict[str, Any], n_experts: int) -> list[int]:
    """HF's rule for which decoder layers have a sparse MoE block."""
    step, dense = hf["decoder_sparse_step"], set(hf.get("mlp_only_layers") or [])
    return [i for i in range(hf["num_hidden_layers"])
            if n_experts > 0 and i not in dense and (i + 1) % step == 0]


def _start_interleave(layers: list[int], n_layers: int) -> tuple[int, int]:
    """(moe_layer_start, moe_layer_interleave) giving exactly ``layers``; ValueError if none does."""
    start = layers[0]
    step = layers[1] - layers[0] if len(layers) > 1 else n_layers
    if list(range(start, n_layers, step)) != layers:
        raise ValueError(f"MoE layers {layers} are not 'every k-th from s' (mlp_only_layers / "
                         f"decoder_sparse_step); ndtrain's moe_layer_start / moe_layer_interleave cannot express them")
    return start, step


def config_from_hf_qwen3_moe(hf: dict[str, Any]) -> ModelConfig:
    """``ModelConfig`` from a Qwen3-MoE config.json dict (omitted fields: ``Qwen3MoeConfig``'s
    defaults). Raises ValueError for another model_type or an unsupported feature (module docstring)."""
    if hf.get("model_type") != "qwen3_moe":
        raise ValueError(f"model_type {hf.get('model_type')!r} is not 'qwen3_moe'")
    hf = with_family_defaults(hf)
    require(hf, _NEEDED)
    if hf.get("use_sliding_window"):
        raise ValueError("sliding-window attention (use_sliding_window) is not supported")
    base = _common(hf)  # biases, activation, RoPE scaling checked there
    dim, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or dim // heads
    n_exp = hf.get("num_experts", hf.get("num_local_experts"))
    if n_exp is None:
        require(hf, ("num_experts",))
    layers = _moe_layers(hf, n_exp)
    moe: dict[str, Any] = {}
    if layers:
        start, step = _start_interleave(layers, hf["num_hidden_layers"])
        moe = dict(moe_experts=n_exp, moe_top_k=hf["num_experts_per_tok"], moe_ffn_hidden=hf["moe_intermediate_size"],
                   moe_score="softmax", moe_renormalize=bool(hf["norm_topk_prob"]), moe_layer_start=start,
                   moe_layer_interleave=step)
    return ModelConfig(name="qwen3_moe", **base, n_kv_heads=hf["num_key_value_heads"] or heads,
                       ffn_hidden=hf["intermediate_size"], attn_head_dim=0 if head_dim * heads == dim else head_dim,
                       qk_norm=True, **moe)


def is_qwen3_moe(cfg: ModelConfig) -> bool:
    """True for models exported as Qwen3-MoE: QK-norm softmax attention (MoE or dense)."""
    return cfg.qk_norm and cfg.attention == "mha" and cfg.block_ffn


def _check_exportable(cfg: ModelConfig) -> None:
    qwen3_next = getattr(cfg, "attn_output_gate", False) or getattr(cfg, "rope_partial_factor", 1.0) != 1.0
    if not is_qwen3_moe(cfg) or cfg.rope_scaling or cfg.mtp_depth or qwen3_next:
        raise ValueError("Qwen3-MoE export needs qk_norm, attention mha, no RoPE scaling, no MTP and no "
                         "Qwen3-Next attention options (attn_output_gate, rope_partial_factor)")
    if cfg.is_moe and (cfg.moe_score, cfg.moe_route_scale, cfg.moe_n_groups, cfg.moe_shared_experts) != (
            "softmax", 1.0, 1, 0):
        raise ValueError("Qwen3-MoE export needs softmax routing, route scale 1, one group and no shared experts")


def config_to_hf_qwen3_moe(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """A ``Qwen3MoeConfig``-compatible dict (transformers 4 and 5) for ``cfg``; MoE layers as
    ``decoder_sparse_step`` = interleave (1 when the MoE layers are off HF's ``(i + 1) % step``
    grid) plus ``mlp_only_layers`` for the grid's dense layers. Raises ValueError if ``cfg`` is not expressible (``_check_exportable``)."""
    _check_exportable(cfg)
    moe = {i for i in range(cfg.n_layers) if cfg.is_moe_layer(i)}
    step = cfg.moe_layer_interleave if cfg.is_moe else 1
    if any((i + 1) % step for i in moe):  # off HF's grid: every layer a candidate, the rest listed dense
        step = 1
    dense = [i for i in range(cfg.n_layers) if (i + 1) % step == 0 and i not in moe]
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        **rope_config(cfg), "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False,
        "use_sliding_window": False, "sliding_window": None, "initializer_range": cfg.init_std,
        "decoder_sparse_step": step, "mlp_only_layers": dense, "num_experts": cfg.moe_experts,
        "num_experts_per_tok": cfg.moe_top_k if cfg.is_moe else 1,
        "moe_intermediate_size": cfg.expert_ffn_dim if cfg.is_moe else cfg.ffn_dim,
        "norm_topk_prob": bool(cfg.moe_renormalize), "torch_dtype": str(dtype).removeprefix("torch."),
    }


def state_dict_from_hf_qwen3_moe(hf_sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename / stack HF Qwen3-MoE weights to ndtrain names (``expert_bias`` buffers zero).
    Raises KeyError naming a missing HF weight."""
    out = state_dict_from_hf_moe(hf_sd, cfg, rope_interleave=False)  # the Mixtral / DeepSeek layout rules
    for i in range(cfg.n_layers):
        for n_name in ("q_norm", "k_norm"):
            key = f"model.layers.{i}.self_attn.{n_name}.weight"
            if key not in hf_sd:
                raise KeyError(f"HF state dict lacks {key}")
            out[f"layers.{i}.attention.{n_name}.weight"] = hf_sd[key]
    return out


def state_dict_to_hf_qwen3_moe(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """ndtrain weights -> HF Qwen3-MoE names, experts per expert; a tied head is left out.
    Raises ValueError (``_check_exportable``; a non-zero ``expert_bias``) or KeyError."""
    _check_exportable(cfg)
    out = export_frame(sd, cfg)
    for i in range(cfg.n_layers):
        hp, npf = f"model.layers.{i}", f"layers.{i}"
        for n_name, h_name in _ATTN.items():
            out[f"{hp}.self_attn.{h_name}.weight"] = sd[f"{npf}.attention.{n_name}.weight"]
        ff = f"{npf}.feed_forward"
        if not cfg.is_moe_layer(i):
            for n_name, h_name in _SWIGLU.items():
                out[f"{hp}.mlp.{h_name}.weight"] = sd[f"{ff}.{n_name}.weight"]
            continue
        if sd[f"{ff}.expert_bias"].any():
            raise ValueError(f"{ff}.expert_bias is non-zero; Qwen3-MoE has no selection bias")
        out[f"{hp}.mlp.gate.weight"] = sd[f"{ff}.router.weight"]
        unstack_experts(out, sd, ff, f"{hp}.mlp", _SWIGLU, cfg.moe_experts)
    return out
