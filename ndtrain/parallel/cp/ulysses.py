"""DeepSpeed-Ulysses context parallel (Jacobs et al. 2023): two all-to-alls turn the sequence split
(B, H, T/cp, D) into a head split (B, H/cp, T, D) around any attention core and back. With G not
divisible by cp the kv heads are repeated to H first. Bytes per layer and rank: (cp-1)/cp *
(S_q + S_k + S_v + S_out) forward, the same backward."""
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
