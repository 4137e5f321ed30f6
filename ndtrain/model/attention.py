"""Causal attention with GQA (Ainslie 2023) and RoPE (Su 2021), as in Llama 2 / 3 (Touvron 2023).
Head counts come from weight shapes at forward time (tp shards heads without touching this file);
``Attention.core`` is replaced per instance by cp."""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ndtrain.model.documents import document_attention
from ndtrain.model.norm import RMSNorm
from ndtrain.model.rope import apply_rope


class KVCacheLike(Protocol):
    """What attention needs from a KV cache (``ndtrain.inference.generate.KVCache`` implements it)."""

    length: int  # tokens already cached (same for every layer during one forward)

    def update(self, layer_id: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v (B, G, T, D) at [length, length + T); return all cached (B, G, length+T, D)."""
        ...


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int = 0) -> torch.Tensor:
    """q (B, H, T, D) at indices ``q_offset + t``, k / v (B, G, S, D) -> (B, H, T, D); query t sees keys
    s <= q_offset + t, scale 1/sqrt(D). Raises ValueError if H % G != 0 or the keys do not cover the
    queries."""
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


def head_max_logits(q: torch.Tensor, k: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
    """Max pre-softmax logit per query head: q (B, H, T, D), k (B, G, T, D) -> (H,), the max over the
    batch and the causal pairs s <= t of q_t . k_s / sqrt(D) (query head h reads kv head h // (H / G),
    as ``enable_gqa``), only pairs of one document when ``documents`` (B, T) is given (the pairs
    attention computes); at least float32 (float64 stays float64). No autograd."""
    b, h, t, d = q.shape
    g = k.shape[1]
    dt = torch.promote_types(q.dtype, torch.float32)
    with torch.no_grad():
        qg = q.detach().to(dt).reshape(b, g, h // g, t, d)
        s = qg @ k.detach().to(dt)[:, :, None].transpose(-1, -2) / d ** 0.5  # (B, G, H/G, T, T)
        seen = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        if documents is not None:  # (B, 1, 1, T, T): a query sees keys of its own document only
            seen = seen & (documents[:, :, None] == documents[:, None, :])[:, None, None]
        return s.masked_fill(~seen, float("-inf")).amax(dim=(0, 3, 4)).reshape(h)


class Attention(nn.Module):
    """``wq``, ``wk``, ``wv``, ``wo`` (no biases), RoPE, causal GQA: x (B, T, C), cos / sin (T, D/2) or
    (B, T, D/2) -> (B, T, C).

    ``head_dim``: D (0 = C / H). ``qk_norm``: RMSNorm over each head's D dims of q and k before RoPE
    (Qwen3, 2025; Dehghani et al. 2023). ``output_gate``: heads times ``sigmoid(wg x)`` before ``wo``
    (Qwen3-Next). ``layer_id`` names the layer in a KV cache.

    ``logit_max``: None (off), or a tensor that each training forward raises to the running
    per-head max of ``head_max_logits`` (an empty tensor starts it); QK-clip
    (``ndtrain.parallel.muon.qk_clip``) sets, reads and resets it. Computed from q and k apart from
    ``core``, so it is the same whichever attention kernel runs."""

    logit_max: torch.Tensor | None = None

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

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             documents: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention, one full sequence: q (B, H, T, D), k / v (B, G, T, D) -> (B, H, T, D);
        with ``documents`` (B, T) ids block-causal (``model.documents``). cp and kernels override it;
        every override takes ``documents`` as a keyword."""
        return causal_attention(q, k, v) if documents is None else document_attention(q, k, v, documents)

    def cached_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int) -> torch.Tensor:
        """Decoding: q (B, H, T, D) after ``past`` cached tokens, k / v (B, G, past + T, D) -> (B, H, T, D).
        Mixers that restrict what a query sees override it."""
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
        """(B, H, T, D) -> (B, T, C) via ``wo``; with ``wg`` first times ``sigmoid(wg x)``, x the block
        input."""
        b, _, t, _ = out.shape
        o = out.transpose(1, 2).reshape(b, t, -1)  # (B, T, H*D)
        if self.wg is not None:
            o = o * torch.sigmoid(self.wg(x))
        return self.wo(o)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCacheLike | None = None, documents: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)
        if self.logit_max is not None and self.training:  # QK-clip's per-head max logit (ndtrain.parallel.muon.qk_clip)
            m = head_max_logits(q, k, documents)
            self.logit_max = m if self.logit_max.numel() == 0 else torch.maximum(self.logit_max, m)
        if kv_cache is None:  # documents (B, T) packed ids: passed to the core only when present
            out = self.core(q, k, v) if documents is None else self.core(q, k, v, documents=documents)
            return self.merge(out, x)
        past = kv_cache.length
        k, v = kv_cache.update(self.layer_id, k, v)  # (B, G, past + T, D)
        return self.merge(self.cached_core(q, k, v, past), x)
