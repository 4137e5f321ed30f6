"""Causal multi-head attention with grouped-query attention (GQA, Ainslie 2023) and RoPE (Su 2021),
as in Llama 2 / Llama 3 (Touvron 2023; Llama 3, 2024).

The per-rank head counts are read from the weight shapes at forward time
(``wq.weight.shape[0] // head_dim``), so tensor parallel can shard heads across ranks without
touching this file. The attention kernel is the overridable ``Attention.core(q, k, v)``: context
parallel replaces it per instance (``block.attention.core = ring_core``) to change how keys and
values are gathered, while projections, RoPE and the KV cache stay here.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ndtrain.model.norm import RMSNorm
from ndtrain.model.rope import apply_rope


class KVCacheLike(Protocol):
    """What attention needs from a KV cache (``ndtrain.inference.generate.KVCache`` implements it)."""

    length: int  # tokens already cached (same for every layer during one forward)

    def update(self, layer_id: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v (B, G, T, D) at [length, length + T); return all cached (B, G, length+T, D)."""
        ...


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int = 0) -> torch.Tensor:
    """Scaled dot-product attention, causal, with GQA broadcasting of kv heads.

    Args:
        q: (B, H, T, D) queries; query t sits at sequence index ``q_offset + t``.
        k, v: (B, G, S, D) keys / values at sequence indices 0 .. S-1; H must be a multiple of G.
        q_offset: number of keys before the first query (the cached length when decoding).

    Returns: (B, H, T, D). Query t attends to keys s <= q_offset + t. Scale 1/sqrt(D).
    Raises ValueError if H is not a multiple of G or the keys do not cover the queries.
    """
    h, g, t, s = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    if h % g:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({g})")
    if q_offset + t != s:
        raise ValueError(f"keys ({s}) must cover the cached prefix ({q_offset}) plus the queries ({t})")
    gqa = h != g
    if q_offset == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if t == 1:  # one new token sees the whole cache: no mask needed
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    qi = torch.arange(t, device=q.device)[:, None] + q_offset  # (T, 1)
    mask = torch.arange(s, device=q.device)[None, :] <= qi  # (T, S) True = attend
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class Attention(nn.Module):
    """Projections ``wq``, ``wk``, ``wv``, ``wo`` (no biases), RoPE, causal GQA; optionally
    ``q_norm`` / ``k_norm``, an RMSNorm over each head's D dims of q and k before RoPE (QK-norm as in
    Qwen3, "Qwen3 Technical Report", 2025; Dehghani et al. 2023), one gain shared by all heads.

    Args:
        dim: model width C.
        n_heads: query heads H; n_kv_heads: kv heads G (H % G == 0).
        layer_id: the block's key in ``Transformer.layers``; names this layer in a KV cache.
        head_dim: D (0 = C / H; Qwen3 uses D != C / H). qk_norm: add ``q_norm`` / ``k_norm`` with
        epsilon ``norm_eps``. output_gate: add ``wg`` (C -> H*D): the heads' output is multiplied by
        ``sigmoid(wg x)`` before ``wo`` (Qwen3-Next's gated attention).

    Shapes: x (B, T, C), cos / sin (T, D/2) or (B, T, D/2) -> (B, T, C).
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, layer_id: str = "0", head_dim: int = 0,
                 qk_norm: bool = False, norm_eps: float = 1e-5, output_gate: bool = False):
        super().__init__()
        if (not head_dim and dim % n_heads) or n_heads % n_kv_heads:
            raise ValueError(f"dim ({dim}) % n_heads ({n_heads}) and n_heads % n_kv_heads "
                             f"({n_kv_heads}) must be 0")
        self.head_dim = head_dim or dim // n_heads
        self.layer_id = layer_id
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)  # (H*D, C)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)  # (G*D, C)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)  # (G*D, C)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)  # (C, H*D)
        # one gain per head dim, shared by the heads, so tensor parallel's head split leaves it whole
        self.q_norm = RMSNorm(self.head_dim, norm_eps) if qk_norm else None  # (D,)
        self.k_norm = RMSNorm(self.head_dim, norm_eps) if qk_norm else None  # (D,)
        # gated attention (Qwen3-Next; Qiu et al. 2025, "Gated Attention for Large Language Models"):
        # a sigmoid gate per output channel, computed from the block input, before wo
        self.wg = nn.Linear(dim, n_heads * self.head_dim, bias=False) if output_gate else None  # (H*D, C)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention over one full sequence: q (B, H, T, D), k / v (B, G, T, D) -> (B, H, T, D).

        Overridable (assign a callable to the instance attribute ``core``) by context parallel.
        """
        return causal_attention(q, k, v)

    def cached_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int) -> torch.Tensor:
        """Decoding: q (B, H, T, D) after ``past`` cached tokens, k / v (B, G, past + T, D) ->
        (B, H, T, D). Mixers that restrict what a query sees (a sliding window) override it."""
        return causal_attention(q, k, v, q_offset=past)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x (B, T, C) -> q (B, H, T, D), k / v (B, G, T, D) with RoPE on q and k; H, G local heads."""
        b, t, _ = x.shape
        d = self.head_dim
        q = self.wq(x).view(b, t, -1, d)  # (B, T, H, D)
        k = self.wk(x).view(b, t, -1, d)  # (B, T, G, D)
        v = self.wv(x).view(b, t, -1, d)  # (B, T, G, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H|G, T, D)

    def merge(self, out: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
        """Heads back to the model width: (B, H, T, D) -> wo -> (B, T, C). With the output gate
        (``wg``), the (B, T, H*D) heads are first multiplied by ``sigmoid(wg x)``, x the block input."""
        b, _, t, _ = out.shape
        o = out.transpose(1, 2).reshape(b, t, -1)  # (B, T, H*D)
        if self.wg is not None:
            o = o * torch.sigmoid(self.wg(x))
        return self.wo(o)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCacheLike | None = None) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)
        if kv_cache is None:
            return self.merge(self.core(q, k, v), x)
        past = kv_cache.length
        k, v = kv_cache.update(self.layer_id, k, v)  # (B, G, past + T, D)
        return self.merge(self.cached_core(q, k, v, past), x)
