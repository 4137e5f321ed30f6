"""Multi-token prediction under context parallel: the shifted tokens and labels cross cp ranks.

MTP depth k (DeepSeek-V3, section 2.2) embeds token t_{i+k} at position i and scores it against
``labels[i + k]``. A cp rank holds only its chunks of each sequence (``context_parallel``'s layout),
so position i + k may live on another rank (always, for the last k positions of a chunk). The hook
below (the model's ``mtp_shift``, ``ndtrain.model.mtp``) all-gathers the rank's (B, T / cp) integer
ids over cp, rebuilds the (B, T) sequence, shifts it by k and cuts this rank's chunks again. It is
int64 ids only, (cp - 1) / cp * B * T * 8 bytes per call, no gradient; every depth then runs on all
local positions (the last k of the sequence get a padding id and an ignored label), so the MTP
blocks' ring / Ulysses attention keeps its equal-size blocks.
"""
from __future__ import annotations

import torch
from torch import nn

from ndtrain.mesh import AxisGroup
from ndtrain.model.mtp import shift_left
from ndtrain.parallel import comm


class ContextParallelShift(nn.Module):
    """``mtp_shift`` hook over ``group``: ``(x (B, T/cp) int ids, k, fill) -> (B, T/cp)`` with
    ``out[:, j] = x_global[:, pos_j + k]`` (``fill`` past the end), ``pos_j`` this rank's global
    positions. ``positions(seq_len, cp, rank, layout, device) -> (T/cp,)`` is the layout's cut
    (``context_parallel.local_positions``). A collective over ``group``: every cp rank must call
    it. No parameters."""

    def __init__(self, group: AxisGroup, layout: str, positions):
        super().__init__()
        self.group, self.layout, self.positions = group, layout, positions

    def forward(self, x: torch.Tensor, k: int, fill: int) -> torch.Tensor:
        n, (b, tl) = self.group.size, x.shape
        parts = x.new_empty((n, b, tl))  # every rank's ids, in rank order
        comm.all_gather_into(parts.view(-1), x.contiguous().view(-1), self.group)
        pos = torch.stack([self.positions(tl * n, n, r, self.layout, x.device) for r in range(n)])  # (cp, Tl)
        full = x.new_empty((b, tl * n))
        full[:, pos.flatten()] = parts.permute(1, 0, 2).reshape(b, -1)  # (B, T) in sequence order
        return shift_left(full, k, fill)[:, pos[self.group.rank]]

    def extra_repr(self) -> str:
        return f"cp={self.group.size}, layout={self.layout}, MTP shifted ids: all-gather"
