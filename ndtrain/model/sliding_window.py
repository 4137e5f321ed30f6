"""Sliding-window causal attention (Beltagy 2020; Mistral 7B, Gemma 3, OLMo 3): query t sees keys
t - w + 1 .. t. ``window_attention`` works in blocks of w queries (O(T w)); ``dense_window_attention``
is its band-masked twin."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ndtrain.model.attention import Attention
from ndtrain.model.documents import same_document


def band_mask(t: int, s: int, window: int, q_offset: int, device) -> torch.Tensor:
    """(T, S) bool, True where query ``q_offset + i`` may attend key j: q - w < j <= q."""
    qi = torch.arange(t, device=device)[:, None] + q_offset
    kj = torch.arange(s, device=device)[None, :]
    return (kj <= qi) & (kj > qi - window)


def dense_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                           q_offset: int = 0, documents: torch.Tensor | None = None) -> torch.Tensor:
    """q (B, H, T, D), k / v (B, G, S, D) with S = q_offset + T -> (B, H, T, D); scale 1/sqrt(D);
    ``documents`` (B, S) ids (q_offset 0): also within a document."""
    mask = band_mask(q.shape[2], k.shape[2], window, q_offset, q.device)
    if documents is not None:
        mask = mask & same_document(documents, documents)  # (B, 1, T, S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                     kv_prev: torch.Tensor | None = None, prev_len: int = 0,
                     documents: torch.Tensor | None = None, prev_documents: torch.Tensor | None = None) -> torch.Tensor:
    """Blocked form: q (B, H, T, D), k / v (B, G, T, D) -> (B, H, T, D). ``kv_prev`` (2, B, G, w - 1, D):
    the positions before this sequence (cp: the previous rank's), the last ``prev_len`` real.
    ``documents`` (B, T) ids, ``prev_documents`` (B, w - 1) those of ``kv_prev``: keys of another
    document are masked."""
    b, h, t, d = q.shape
    g = k.shape[1]
    w = window if kv_prev is not None else min(window, t)  # a block must reach window - 1 back
    n = -(-t // w)
    pad = n * w - t
    qb = F.pad(q, (0, 0, 0, pad)).view(b, h, n, w, d).transpose(1, 2).reshape(b * n, h, w, d)
    if kv_prev is None:  # one block of front padding, masked below
        kp, vp = (F.pad(x, (0, 0, w, pad)) for x in (k, v))  # (B, G, w + n*w, D)
    else:  # the front block: one masked slot, then the previous window - 1 positions
        front = F.pad(kv_prev, (0, 0, 1, 0))  # (2, B, G, w, D)
        kp, vp = (torch.cat([f, F.pad(x, (0, 0, 0, pad))], dim=2) for f, x in zip(front, (k, v)))

    def two_blocks(x: torch.Tensor) -> torch.Tensor:  # block i sees padded blocks i and i + 1
        blocks = x.view(b, g, n + 1, w, d)
        return torch.cat([blocks[:, :, :-1], blocks[:, :, 1:]], dim=3).transpose(1, 2).reshape(b * n, g, 2 * w, d)

    kb, vb = two_blocks(kp), two_blocks(vp)
    qpos = torch.arange(n * w, device=q.device).view(n, w, 1)  # query positions in this sequence
    kpos = (torch.arange(n, device=q.device)[:, None] * w + torch.arange(2 * w, device=q.device) - w).view(n, 1, 2 * w)
    mask = (kpos <= qpos) & (kpos > qpos - window) & (kpos >= -prev_len)  # (N, w, 2w)
    mask = mask[None, :, None].expand(b, n, 1, w, 2 * w)
    if documents is not None:
        mask = mask & _block_documents(documents, prev_documents, w, n, pad)
    mask = mask.reshape(b * n, 1, w, 2 * w)
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, enable_gqa=g != h)  # (B*N, H, w, D)
    return out.view(b, n, h, w, d).transpose(1, 2).reshape(b, h, n * w, d)[:, :, :t]


def _block_documents(documents, prev_documents, w: int, n: int, pad: int) -> torch.Tensor:
    """(B, N, 1, w, 2w) True where a block's query and key share a document; padding ids are -1
    (front, never visible by position) and -2 (tail: padded queries see themselves)."""
    b = documents.shape[0]
    docs = F.pad(documents, (0, pad), value=-2)  # (B, N*w)
    front = (documents.new_full((b, w), -1) if prev_documents is None
             else F.pad(prev_documents.to(documents.dtype), (1, 0), value=-1))  # (B, w)
    kd = torch.cat([front, docs], dim=1).view(b, n + 1, w)
    kd = torch.cat([kd[:, :-1], kd[:, 1:]], dim=2)  # (B, N, 2w)
    qd = docs.view(b, n, w)
    return (qd[..., :, None] == kd[..., None, :])[:, :, None]


class SlidingWindowAttention(Attention):
    """``Attention`` restricted to ``cfg.swa_window`` keys: x (B, T, C), cos / sin (T, D/2) -> (B, T, C).
    Decoding keeps the full cache and masks it."""

    def __init__(self, cfg, layer_id: str = "0"):
        super().__init__(cfg.dim, cfg.n_heads, cfg.kv_heads, layer_id)
        self.window = cfg.swa_window

    def core(self, q, k, v, documents=None):
        return window_attention(q, k, v, self.window, documents=documents)

    def cached_core(self, q, k, v, past):
        return dense_window_attention(q, k, v, self.window, q_offset=past)
