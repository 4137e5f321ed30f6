"""Packed documents: the (B, T) int document ids every mixer may receive (``documents``), and what the
mixers derive from them.

Ids are non-decreasing along a row and change exactly where a document starts (``ndtrain.data``
numbers them 0, 1, ... per row). A token attends only to earlier tokens of its own document; a
linear mixer's state is zeroed just before a document's first token and its short convolution sees
zeros for inputs of another document. Everything here is exact (masks, no approximation), so a
packed row gives each document's own forward."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def document_starts(documents: torch.Tensor, prev: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) ids -> (B, T) bool, True at each token whose document differs from the token before;
    token 0 compares with ``prev`` (B,) (the id just before this slice, e.g. the previous cp rank's
    last), else is False (nothing precedes it)."""
    starts = torch.zeros(documents.shape, dtype=torch.bool, device=documents.device)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    if prev is not None:
        starts[:, 0] = documents[:, 0] != prev
    return starts


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """(B, T) ids -> (B, T) int64 positions restarting at 0 at each document start (RoPE's)."""
    b, t = documents.shape
    idx = torch.arange(t, device=documents.device).expand(b, t)
    starts = document_starts(documents)
    starts[:, 0] = True
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values  # (B, T) start index
    return idx - first


def same_document(q_doc: torch.Tensor, k_doc: torch.Tensor) -> torch.Tensor:
    """(B, Tq), (B, Tk) ids -> (B, 1, Tq, Tk) bool, True where query and key share a document."""
    return (q_doc[:, :, None] == k_doc[:, None, :])[:, None]


def document_causal_mask(documents: torch.Tensor) -> torch.Tensor:
    """(B, T) ids -> (B, 1, T, T) bool block-causal mask (True = attend): key s <= query t and the same
    document. The diagonal is always True, so no row is empty."""
    t = documents.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=documents.device).tril()
    return same_document(documents, documents) & causal


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       documents: torch.Tensor) -> torch.Tensor:
    """Block-causal SDPA: q (B, H, T, D), k (B, G, T, D), v (B, G, T, Dv), documents (B, T) ->
    (B, H, T, Dv); scale 1/sqrt(D)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=document_causal_mask(documents),
                                          enable_gqa=q.shape[1] != k.shape[1])


def varlen_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              documents: torch.Tensor) -> torch.Tensor:
    """The slow twin of ``document_attention``: causal SDPA on each document's tokens alone (the
    varlen form), same shapes."""
    out = q.new_empty(q.shape[:-1] + v.shape[-1:])
    for b in range(q.shape[0]):
        for d in torch.unique_consecutive(documents[b]).tolist():
            idx = (documents[b] == d).nonzero().flatten()
            out[b:b + 1, :, idx] = F.scaled_dot_product_attention(
                q[b:b + 1, :, idx], k[b:b + 1, :, idx], v[b:b + 1, :, idx], is_causal=True,
                enable_gqa=q.shape[1] != k.shape[1])
    return out


def conv_document_mask(documents: torch.Tensor, width: int, prev: torch.Tensor | None = None) -> torch.Tensor:
    """Which taps of a width-W causal convolution stay in the token's document: (B, T) ids and ``prev``
    (B, W-1) ids of the left context (None: a different document) -> (B, T, W) bool, tap i reading
    token t - (W-1) + i."""
    b = documents.shape[0]
    left = (prev if prev is not None else documents.new_full((b, width - 1), -1)).to(documents.dtype)
    padded = torch.cat([left, documents], dim=1)  # (B, W-1+T)
    windows = padded.unfold(1, width, 1)  # (B, T, W)
    return windows == documents[..., None]


def masked_causal_conv(xp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       keep: torch.Tensor) -> torch.Tensor:
    """Depthwise causal convolution with taps outside the document dropped: xp (B, W-1+T, Ch) the
    input with its left context, weight (Ch, 1, W), keep (B, T, W) -> (B, T, Ch)."""
    w = weight.shape[-1]
    windows = xp.unfold(1, w, 1)  # (B, T, Ch, W)
    windows = windows * keep[:, :, None, :].to(xp.dtype)
    y = torch.einsum("btcw,cw->btc", windows, weight[:, 0].to(xp.dtype))
    return y if bias is None else y + bias.to(xp.dtype)
