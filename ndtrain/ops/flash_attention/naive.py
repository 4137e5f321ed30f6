"""Reference attention for packed variable-length sequences with GQA, materialising the scores.

Documents are packed along one token axis and delimited by ``cu_seqlens`` (cumulative lengths, the
convention of FlashAttention's varlen API): tokens of document i are ``cu_seqlens[i]:cu_seqlens[i+1]``
and attend only within their document.
"""
from __future__ import annotations

import math
from itertools import pairwise

import torch


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                    causal: bool = True, scale: float | None = None) -> torch.Tensor:
    """Softmax attention per document. q (N, H, D), k / v (N, G, D) packed tokens, H % G == 0 (query
    head h reads kv head h // (H / G)); cu_seqlens (S+1,) int, cu_seqlens[0] = 0, cu_seqlens[-1] = N.
    Returns (N, H, D) in q's dtype; scores and softmax in fp32; scale defaults to 1/sqrt(D).
    Raises ValueError if H is not a multiple of G.
    """
    h, d = q.shape[1:]
    g = k.shape[1]
    if h % g:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({g})")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for s0, s1 in pairwise(bounds):
        qs = q[s0:s1].float().transpose(0, 1)  # (H, L, D)
        ks = k[s0:s1].float().transpose(0, 1).repeat_interleave(h // g, 0)  # (H, L, D)
        vs = v[s0:s1].float().transpose(0, 1).repeat_interleave(h // g, 0)
        scores = qs @ ks.transpose(1, 2) * scale  # (H, L, L)
        if causal:
            keep = torch.ones(s1 - s0, s1 - s0, dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(~keep, float("-inf"))
        out[s0:s1] = (scores.softmax(-1) @ vs).transpose(0, 1).to(q.dtype)  # (L, H, D)
    return out


def cu_seqlens_of(documents: torch.Tensor) -> torch.Tensor:
    """(B, T) packed document ids (non-decreasing per row) -> (S + 1,) int32 cumulative bounds over
    the flattened B*T tokens: a bound where the id changes and at every row start."""
    starts = torch.ones(documents.shape, dtype=torch.bool, device=documents.device)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    end = torch.tensor([documents.numel()], device=documents.device)
    return torch.cat([starts.flatten().nonzero().flatten(), end]).to(torch.int32)
