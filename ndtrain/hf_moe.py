"""Hugging Face MoE checkpoint import: Mixtral (``MixtralForCausalLM``) and DeepSeek-V3
(``DeepseekV3ForCausalLM``: MoE + MLA), config.json + safetensors -> ``Transformer``.

``ndtrain.hf.load_hf_checkpoint`` dispatches here for ``model_type`` mixtral / deepseek_v3; the
inverse (export) is ``ndtrain.hf_moe_export``. Fields a config.json omits take the defaults of
``transformers.MixtralConfig`` / ``DeepseekV3Config`` (``hf_common.with_family_defaults``; without
transformers a missing numeric field raises ValueError instead of borrowing another family's value).

Mapping notes:

* Experts are stored per expert by HF (``experts.{j}.w1`` / ``gate_proj`` ...); they are stacked
  into ndtrain's (E, F, C) / (E, C, F) tensors. The fused layout transformers may also use
  (``experts.gate_up_proj`` (E, 2F, C), ``experts.down_proj`` (E, C, F)) is accepted too.
* Mixtral routing = ndtrain ``moe_score=softmax``, ``moe_renormalize=True``. DeepSeek-V3 routing =
  ``sigmoid`` scores, ``e_score_correction_bias`` -> ``expert_bias`` (selection only),
  group-limited selection (``n_group`` / ``topk_group``), ``norm_topk_prob``,
  ``routed_scaling_factor``; ``first_k_dense_replace`` -> ``moe_layer_start``.
* DeepSeek's RoPE slice is interleaved (``rope_interleave``: pairs (2i, 2i+1)); ndtrain rotates
  halves, so the RoPE rows of ``q_b_proj`` (per head) and of ``kv_a_proj_with_mqa`` are permuted
  (evens first, then odds) on import. Since q and k get the same permutation, q . k is unchanged.
* Not supported (ValueError): attention / MLP biases, non-SiLU activations, sliding-window
  attention, RoPE scaling (DeepSeek-V3's released config uses YaRN; import it with the scaling
  removed only if you accept the different long-context behaviour). MTP weights
  (``model.layers.{L}``, absent from transformers' model) are not imported: ``mtp_depth = 0``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ndtrain.config import ModelConfig
from ndtrain.hf_common import (
    model_from_state_dict,
    read_safetensors,
    require,
    rope_params,
    with_family_defaults,
)
from ndtrain.model import Transformer

MOE_MODEL_TYPES = ("mixtral", "deepseek_v3")
_ATTN = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo"}
_MLA = {"q_proj": "wq", "q_a_proj": "wq_a", "q_a_layernorm": "q_norm", "q_b_proj": "wq_b",
        "kv_a_proj_with_mqa": "wkv_a", "kv_a_layernorm": "kv_norm", "kv_b_proj": "wkv_b", "o_proj": "wo"}
_SWIGLU = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2", "w1": "w1", "w3": "w3", "w2": "w2"}


_NEEDED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "rms_norm_eps",
           "max_position_embeddings", "tie_word_embeddings", "intermediate_size", "num_experts_per_tok")
_NEEDED_BY_KIND = {
    "mixtral": ("num_key_value_heads", "num_local_experts"),
    "deepseek_v3": ("n_routed_experts", "n_shared_experts", "moe_intermediate_size", "norm_topk_prob",
                    "routed_scaling_factor", "n_group", "topk_group", "first_k_dense_replace", "q_lora_rank",
                    "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "rope_interleave"),
}


def _common(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError("attention / MLP biases are not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf['hidden_act']!r} is not 'silu'")
    theta, scaling = rope_params(hf)
    if scaling is not None:
        raise ValueError(f"RoPE scaling {scaling.get('rope_type', scaling.get('type'))!r} is not supported "
                         "for MoE imports")
    extra = {"init_std": hf["initializer_range"]} if "initializer_range" in hf else {}
    return dict(vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
                n_heads=hf["num_attention_heads"], norm_eps=hf["rms_norm_eps"], rope_theta=theta,
                max_seq_len=hf["max_position_embeddings"], tie_embeddings=bool(hf["tie_word_embeddings"]),
                **extra)


def config_from_hf_moe(hf: dict[str, Any]) -> ModelConfig:
    """``ModelConfig`` from a Mixtral or DeepSeek-V3 config.json dict; fields it omits take the
    defaults of ``transformers.MixtralConfig`` / ``DeepseekV3Config`` (``with_family_defaults``;
    without transformers a missing numeric field raises ValueError). Raises ValueError for other
    model types or unsupported features (see module docstring)."""
    kind = hf.get("model_type")
    if kind not in MOE_MODEL_TYPES:
        raise ValueError(f"model_type {kind!r} is not one of {MOE_MODEL_TYPES}")
    hf = with_family_defaults(hf)
    require(hf, _NEEDED + _NEEDED_BY_KIND[kind])
    base = _common(hf)
    if kind == "mixtral":
        if hf.get("sliding_window") is not None:
            raise ValueError("sliding-window attention is not supported")
        dim, heads = hf["hidden_size"], hf["num_attention_heads"]
        if hf.get("head_dim") not in (None, dim // heads):
            raise ValueError(f"head_dim {hf['head_dim']} != hidden_size / num_attention_heads")
        return ModelConfig(name="mixtral", **base, n_kv_heads=hf["num_key_value_heads"] or heads,
                           ffn_hidden=hf["intermediate_size"], moe_experts=hf["num_local_experts"],
                           moe_top_k=hf["num_experts_per_tok"], moe_ffn_hidden=hf["intermediate_size"],
                           moe_score="softmax", moe_renormalize=True)
    return ModelConfig(
        name="deepseek_v3", **base, ffn_hidden=hf["intermediate_size"],
        moe_experts=hf["n_routed_experts"], moe_top_k=hf["num_experts_per_tok"],
        moe_shared_experts=hf["n_shared_experts"] or 0, moe_ffn_hidden=hf["moe_intermediate_size"],
        moe_score="sigmoid", moe_renormalize=bool(hf["norm_topk_prob"]),
        moe_route_scale=float(hf["routed_scaling_factor"]),
        moe_n_groups=hf["n_group"] or 1, moe_topk_groups=hf["topk_group"] or 1,
        moe_layer_start=hf["first_k_dense_replace"] or 0, attention="mla",
        mla_q_rank=hf["q_lora_rank"] or 0, mla_kv_rank=hf["kv_lora_rank"],
        mla_rope_dim=hf["qk_rope_head_dim"], mla_nope_dim=hf["qk_nope_head_dim"], mla_v_dim=hf["v_head_dim"])


def _deinterleave(w: torch.Tensor, start: int, width: int, period: int,
                  inverse: bool = False) -> torch.Tensor:
    """Permute, in every block of ``period`` rows, rows [start, start+width) to evens then odds
    (``inverse``: back from evens-then-odds to interleaved pairs, as export writes them)."""
    perm = torch.cat([torch.arange(0, width, 2), torch.arange(1, width, 2)]) + start  # (width,)
    rows = w.view(-1, period, *w.shape[1:]).clone()  # (blocks, period, ...)
    if inverse:
        rows[:, perm] = rows[:, start:start + width].clone()
    else:
        rows[:, start:start + width] = rows[:, perm]
    return rows.view_as(w)


def _stack_experts(hf_sd: dict, prefix: str, n: int, name: str) -> torch.Tensor:
    """(E, out, in) from ``{prefix}.experts.{j}.{name}.weight`` for j < n."""
    try:
        return torch.stack([hf_sd[f"{prefix}.experts.{j}.{name}.weight"] for j in range(n)])
    except KeyError as e:
        raise KeyError(f"HF state dict lacks {e.args[0]}") from None


def state_dict_from_hf_moe(hf_sd: dict[str, torch.Tensor], cfg: ModelConfig,
                           rope_interleave: bool = True) -> dict[str, torch.Tensor]:
    """Rename / stack HF Mixtral or DeepSeek-V3 weights to ndtrain names (model parameters and the
    ``expert_bias`` buffers). Raises KeyError naming a missing HF weight."""
    def get(key: str) -> torch.Tensor:
        if key not in hf_sd:
            raise KeyError(f"HF state dict lacks {key}")
        return hf_sd[key]

    out = {"tok_embeddings.weight": get("model.embed_tokens.weight"), "norm.weight": get("model.norm.weight"),
           "output.weight": hf_sd.get("lm_head.weight", hf_sd.get("model.embed_tokens.weight"))}
    mla = cfg.attention == "mla"
    for i in range(cfg.n_layers):
        hp, npf = f"model.layers.{i}", f"layers.{i}"
        out[f"{npf}.attention_norm.weight"] = get(f"{hp}.input_layernorm.weight")
        out[f"{npf}.ffn_norm.weight"] = get(f"{hp}.post_attention_layernorm.weight")
        skip = (("q_proj",) if cfg.mla_q_rank else ("q_a_proj", "q_a_layernorm", "q_b_proj")) if mla else ()
        for h_name, n_name in (_MLA if mla else _ATTN).items():
            if h_name not in skip:
                out[f"{npf}.attention.{n_name}.weight"] = get(f"{hp}.self_attn.{h_name}.weight")
        if mla and rope_interleave:
            qk = (cfg.mla_nope_dim or cfg.head_dim) + cfg.mla_rope_dim
            q_key = f"{npf}.attention.{'wq_b' if cfg.mla_q_rank else 'wq'}.weight"
            out[q_key] = _deinterleave(out[q_key], qk - cfg.mla_rope_dim, cfg.mla_rope_dim, qk)
            kv_key = f"{npf}.attention.wkv_a.weight"
            out[kv_key] = _deinterleave(out[kv_key], cfg.mla_kv_rank, cfg.mla_rope_dim, out[kv_key].shape[0])
        ff = f"{npf}.feed_forward"
        if not cfg.is_moe_layer(i):
            for h_name in ("gate_proj", "up_proj", "down_proj"):
                out[f"{ff}.{_SWIGLU[h_name]}.weight"] = get(f"{hp}.mlp.{h_name}.weight")
            continue
        moe = f"{hp}.block_sparse_moe" if f"{hp}.block_sparse_moe.gate.weight" in hf_sd else f"{hp}.mlp"
        out[f"{ff}.router.weight"] = get(f"{moe}.gate.weight")
        out[f"{ff}.expert_bias"] = hf_sd.get(f"{moe}.gate.e_score_correction_bias",
                                             torch.zeros(cfg.moe_experts))
        if f"{moe}.experts.gate_up_proj" in hf_sd:  # fused layout
            f = cfg.expert_ffn_dim
            gate_up = hf_sd[f"{moe}.experts.gate_up_proj"]  # (E, 2F, C)
            out[f"{ff}.experts.w1"], out[f"{ff}.experts.w3"] = gate_up[:, :f], gate_up[:, f:]
            out[f"{ff}.experts.w2"] = get(f"{moe}.experts.down_proj")  # (E, C, F)
        else:
            names = ("w1", "w3", "w2") if cfg.name == "mixtral" else ("gate_proj", "up_proj", "down_proj")
            for h_name in names:
                out[f"{ff}.experts.{_SWIGLU[h_name]}"] = _stack_experts(hf_sd, moe, cfg.moe_experts, h_name)
        if cfg.moe_shared_experts:
            for h_name in ("gate_proj", "up_proj", "down_proj"):
                out[f"{ff}.shared.{_SWIGLU[h_name]}.weight"] = get(f"{moe}.shared_experts.{h_name}.weight")
    return out


def load_hf_moe_checkpoint(folder: str | Path, device: torch.device | str = "cpu",
                           dtype: torch.dtype = torch.float32) -> tuple[ModelConfig, Transformer]:
    """Read a Mixtral / DeepSeek-V3 checkpoint folder into a ``Transformer`` (``dtype`` parameters;
    router and expert biases follow ``dtype`` too). Raises FileNotFoundError, ValueError, KeyError."""
    folder = Path(folder)
    hf = with_family_defaults(json.loads((folder / "config.json").read_text()))
    cfg = config_from_hf_moe(hf)
    sd = state_dict_from_hf_moe(read_safetensors(folder), cfg, bool(hf.get("rope_interleave", True)))
    return cfg, model_from_state_dict(cfg, sd, device, dtype)
