"""One decoder block: pre-norm attention (MHA / GQA / MLA) and pre-norm FFN (dense or MoE).

Llama (Touvron et al. 2023) layout; MLA and MoE from DeepSeek-V2/V3.
"""
from __future__ import annotations

import torch
from torch import nn

from ndtrain.config import ModelConfig
from ndtrain.model.attention import KVCacheLike
from ndtrain.model.mixers import build_mixer, mixer_kinds
from ndtrain.model.mlp import FeedForward
from ndtrain.model.moe import MoE
from ndtrain.model.norm import RMSNorm


class TransformerBlock(nn.Module):
    """``h = x + attention(attention_norm(x)); out = h + feed_forward(ffn_norm(h))``; x (B, T, C), cos /
    sin (T, D_rope/2) or (B, T, D_rope/2) -> (B, T, C). ``attention``: the layer's mixer (``Attention``,
    ``MLAttention`` or ``mixers``); ``feed_forward``: ``FeedForward`` or ``MoE``. Without
    ``cfg.block_ffn`` only the mixer half (Mamba-2)."""

    def __init__(self, cfg: ModelConfig, layer_id: str, layer_index: int | None = None):
        super().__init__()
        self.layer_id = layer_id
        index = int(layer_id) if layer_index is None else layer_index
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        kinds = mixer_kinds(cfg)  # token mixer per layer by model.layer_pattern; MTP blocks: attention
        self.mixer = kinds[index] if index < len(kinds) else "attention"
        self.attention = build_mixer(cfg, layer_id, self.mixer)
        self.ffn_norm: RMSNorm | None = None
        self.feed_forward: nn.Module | None = None
        if cfg.block_ffn:
            self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.feed_forward = MoE(cfg) if cfg.is_moe_layer(index) else FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCacheLike | None = None, documents: torch.Tensor | None = None) -> torch.Tensor:
        """``documents``: (B, T) packed document ids (``model.documents``) or None."""
        a = self.attention_norm(x)
        h = x + (self.attention(a, cos, sin, kv_cache) if documents is None
                 else self.attention(a, cos, sin, kv_cache, documents))  # (B, T, C)
        if self.feed_forward is None:
            return h
        return h + self.feed_forward(self.ffn_norm(h))  # (B, T, C)
