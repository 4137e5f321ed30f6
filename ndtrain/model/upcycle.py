"""Sparse upcycling (Komatsuzaki et al. 2023): an MoE model from a dense checkpoint, every expert a
copy of its layer's FFN, a new router. With weights summing to 1, no shared experts and no
dropping, the MoE output is ``sum_j w_j FFN(x) = FFN(x)``: the step-0 loss equals the dense one."""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ndtrain.config import ModelConfig
from ndtrain.model.transformer import build_model

_MOE_FIELDS = {f.name for f in dataclasses.fields(ModelConfig) if f.name.startswith("moe_")}


def upcycle(dense: nn.Module, moe_cfg: ModelConfig, seed: int = 0) -> nn.Module:
    """A new MoE ``Transformer`` from ``dense`` on its device and dtype, in train mode. ``moe_cfg`` must
    equal dense's config but for ``moe_*`` (experts as wide as the FFN, no shared experts); ``seed``
    draws the routers. Raises ValueError otherwise."""
    dcfg: ModelConfig = dense.cfg
    if not moe_cfg.is_moe:
        raise ValueError("upcycle: moe_cfg.moe_experts must be > 0")
    diff = [f.name for f in dataclasses.fields(ModelConfig)
            if f.name not in _MOE_FIELDS | {"name"} and getattr(dcfg, f.name) != getattr(moe_cfg, f.name)]
    if diff:
        raise ValueError(f"upcycle: dense and MoE configs differ in {diff}")
    if moe_cfg.expert_ffn_dim != dcfg.ffn_dim or moe_cfg.moe_shared_experts:
        raise ValueError(f"upcycle: experts must copy the dense FFN (moe_ffn_hidden {moe_cfg.expert_ffn_dim} "
                         f"vs ffn_dim {dcfg.ffn_dim}) and moe_shared_experts must be 0")
    p = next(dense.parameters())
    moe = build_model(moe_cfg, p.device, p.dtype, seed)
    src = dense.state_dict()
    dst = moe.state_dict()
    with torch.no_grad():
        for name, t in dst.items():
            if name in src:
                t.copy_(src[name])
        for i in range(moe_cfg.n_layers):
            if not moe_cfg.is_moe_layer(i):
                continue
            for w in ("w1", "w2", "w3"):
                dense_w = src[f"layers.{i}.feed_forward.{w}.weight"]  # (F, C) or (C, F)
                dst[f"layers.{i}.feed_forward.experts.{w}"].copy_(dense_w.expand_as(dst[f"layers.{i}.feed_forward.experts.{w}"]))
    moe.load_state_dict(dst)
    return moe
