"""DeepSpeed-Ulysses context parallel (Jacobs et al. 2023): trade the sequence split for a head
split around the attention core with two all-to-alls.

Each rank holds q (B, H, T/cp, D) and k, v (B, G, T/cp, D) for its contiguous slice of the
sequence. An all-to-all turns them into (B, H/cp, T, D): every rank then runs ordinary
full-sequence attention (any core, causal or not) for H/cp heads, and a second all-to-all turns the
output back into (B, H, T/cp, D). With G not divisible by cp the kv heads are first repeated to H
(GQA broadcast), so every rank gets the kv heads its query heads use.

Communication per layer (bytes sent per rank, S = bytes of one of q / k / v / out on this rank):
forward (cp-1)/cp * (S_q + S_k + S_v + S_out); backward the same (the inverse all-to-alls).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ndtrain.mesh import AxisGroup
from ndtrain.parallel.cp.collectives import AllToAll
from ndtrain.parallel.cp.rules import check_heads

HEAD_DIM, SEQ_DIM = 1, 2  # q / k / v are (B, H, T, D)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: AxisGroup,
                      inner: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """q (B, H, Tl, D), k / v (B, G, Tl, D), sequence-split contiguously over ``group`` ->
    ``inner`` on (B, H/cp, T, D) -> (B, H, Tl, D). Raises ValueError when H % cp != 0."""
    n = group.size
    h, g = q.shape[HEAD_DIM], k.shape[HEAD_DIM]
    check_heads(h, n)
    if g % n:  # give every rank whole kv groups: broadcast kv heads to the query heads
        k, v = k.repeat_interleave(h // g, dim=HEAD_DIM), v.repeat_interleave(h // g, dim=HEAD_DIM)
    q = AllToAll.apply(q, group, HEAD_DIM, SEQ_DIM)  # (B, H/cp, T, D)
    k = AllToAll.apply(k, group, HEAD_DIM, SEQ_DIM)  # (B, G'/cp, T, D)
    v = AllToAll.apply(v, group, HEAD_DIM, SEQ_DIM)
    out = inner(q, k, v)  # (B, H/cp, T, D)
    return AllToAll.apply(out, group, SEQ_DIM, HEAD_DIM)  # (B, H, Tl, D)
