"""MTP under context parallel: position i + k may be on another cp rank, so the model's ``mtp_shift``
hook all-gathers the (B, T / cp) int ids, shifts the whole sequence by k and cuts this rank's
chunks again: (cp - 1) / cp * B * T * 8 bytes, no gradient. Every depth then runs on all local
positions (padding id and ignored label past the end), keeping ring / Ulysses blocks equal."""
from __future__ import annotations

import torch
from torch import nn

from ndtrain.mesh import AxisGroup
from ndtrain.model.mtp import shift_left
from ndtrain.parallel import comm


class ContextParallelShift(nn.Module):
    """``mtp_shift`` over ``group``: (x (B, T/cp) ids, k, fill) -> (B, T/cp), ``out[:, j] =
    x_global[:, pos_j + k]`` (``fill`` past the end). Collective: every cp rank calls it."""

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
