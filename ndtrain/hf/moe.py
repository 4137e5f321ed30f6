"""Hugging Face MoE checkpoints, import and export: Mixtral (``MixtralForCausalLM``) and DeepSeek-V3
(``DeepseekV3ForCausalLM``: MoE + MLA), config.json + safetensors -> ``Transformer``.

``ndtrain.hf.folder.load_hf_checkpoint`` dispatches here for ``model_type`` mixtral / deepseek_v3; the
inverse (export, ``config_to_hf_moe`` / ``state_dict_to_hf_moe``) is at the end of this module. Fields a config.json omits take the defaults of
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
import warnings
from pathlib import Path
from typing import Any

import torch

from ndtrain.config import ModelConfig
from ndtrain.hf.common import (
    export_frame,
    model_from_state_dict,
    read_safetensors,
    require,
    rope_config,
    rope_params,
    unstack_experts,
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


# ---- export: ndtrain Transformer -> Mixtral / DeepSeek-V3 config + state dict ----
# ``ndtrain.hf.folder.save_hf_checkpoint`` dispatches here for MoE / MLA models (``is_hf_moe_exportable``).
# Which family: MLA attention -> DeepSeek-V3; otherwise Mixtral. Experts are written per expert in
# the checkpoint layout of the released models (Mixtral ``block_sparse_moe.experts.{j}.w1/w3/w2``,
# DeepSeek ``mlp.experts.{j}.gate_proj/up_proj/down_proj``), which transformers 4 and 5 both load.
# DeepSeek's RoPE rows are written back interleaved (``rope_interleave: true``), so an imported
# checkpoint is re-exported with the original tensors; ``expert_bias`` -> ``e_score_correction_bias``.
#
# Raises ValueError for what the target family cannot express (its routing, a layer pattern other
# than its own, RoPE scaling, a non-zero Mixtral ``expert_bias``). MTP modules (``mtp_depth > 0``)
# are not exported (transformers has no MTP): ``num_nextn_predict_layers`` is written as 0.

# ndtrain name -> HF name: the import tables above, inverted
_ATTN_OUT = {v: k for k, v in _ATTN.items()}
_MLA_OUT = {v: k for k, v in _MLA.items()}
_DENSE = {v: k for k, v in _SWIGLU.items() if k.endswith("_proj")}


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
           for n, h in (_MLA_OUT if mla else _ATTN_OUT).items() if f"{npf}.attention.{n}.weight" in sd}
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