"""Dim-0 sharding with padding of a group of parameters into one flat buffer (ZeRO / FSDP;
docs/sharded_data_parallel.md, "The layout").

    parameter i: shape (d0_i, *rest_i), c_i = prod(rest_i) elements per row
    rows per shard r_i = ceil(d0_i / N), padded shard size s_i = r_i * c_i, offset o_i = sum_{j<i} s_j
    flat shard (S,), S = sum_i s_i; the gathered buffer (N * S,) viewed (N, S) holds rank k's shard
    in row k, so parameter i's rows k*r_i .. (k+1)*r_i - 1 are columns [o_i, o_i + s_i) of row k.

``torch.chunk`` / DTensor ``Shard(0)`` semantics, so checkpoints load under any layout. Padding is
real traffic (``comm`` counts it). A 0-d parameter is one row of one element, an empty one takes no
space. ``pack`` (``torch._chunk_cat``) has the slow twin ``pack_reference``."""
from __future__ import annotations

import math

import torch


class FlatShardLayout:
    """The padded dim-0 layout of ``shapes`` over ``n`` ranks, seen from ``rank``.

    Attributes: ``d0[i]`` (1 for 0-d), ``cols[i]`` (c_i), ``rows[i]`` (r_i), ``sizes[i]`` (s_i),
    ``offsets[i]`` (o_i), ``shard_numel`` (S), ``valid_rows[i]`` (rows really held, 0 .. r_i).
    Raises ValueError for ``n`` < 1 or ``rank`` outside [0, n)."""

    def __init__(self, shapes: list[torch.Size], n: int, rank: int):
        if n < 1 or not 0 <= rank < n:
            raise ValueError(f"rank ({rank}) must be in [0, n={n})")
        self.shapes = [torch.Size(s) for s in shapes]
        self.n, self.rank = n, rank
        self.d0, self.rows, self.sizes, self.offsets, self.valid_rows, self.cols = [], [], [], [], [], []
        off = 0
        for s in self.shapes:
            d0, c = (s[0], math.prod(s[1:])) if len(s) else (1, 1)  # a scalar is one row of one
            r = -(-d0 // n)
            self.d0.append(d0)
            self.rows.append(r)
            self.cols.append(c)
            self.sizes.append(r * c)
            self.offsets.append(off)
            self.valid_rows.append(max(0, min(r, d0 - rank * r)))
            off += r * c
        self.shard_numel = off

    @property
    def padded_numel(self) -> int:
        """N * S: elements one all-gather produces (and one reduce-scatter consumes)."""
        return self.n * self.shard_numel

    def row_range(self, i: int) -> tuple[int, int]:
        """Global rows [lo, hi) of parameter ``i`` held by this rank."""
        lo = min(self.rank * self.rows[i], self.d0[i])
        return lo, lo + self.valid_rows[i]

    def shard_view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s padded shard inside a flat shard (S,): a (r_i, *rest_i) view."""
        o = self.offsets[i]
        return flat[o:o + self.sizes[i]].view(self.rows[i], *self.shapes[i][1:])

    def valid_view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """The unpadded rows of parameter ``i`` in a flat shard: (valid_rows_i, *rest_i) view."""
        return self.shard_view(flat, i)[: self.valid_rows[i]]

    @torch.no_grad()
    def shard_from_full(self, fulls: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """Write this rank's rows of each full tensor into ``out`` (S,), padding with zeros."""
        out.zero_()
        for i, full in enumerate(fulls):
            lo, hi = self.row_range(i)
            c, o = self.cols[i], self.offsets[i]
            out[o:o + (hi - lo) * c].copy_(full.reshape(-1)[lo * c:hi * c])
        return out

    @torch.no_grad()
    def pack(self, tensors: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """Reduce-scatter input: full tensors (``shapes[i]``) -> ``out`` (N * S,), padded. A dtype differing
        from ``out``'s is cast while copying (``pack_reference``), not materialised."""
        if any(t.dtype != out.dtype for t in tensors):
            return self.pack_reference(tensors, out)
        # (d0, c) each; empty tensors take no space in the layout (and _chunk_cat rejects them)
        views = [t.reshape(self.d0[i], self.cols[i]) for i, t in enumerate(tensors) if self.sizes[i]]
        if views:
            torch._chunk_cat(views, dim=0, num_chunks=self.n, out=out.view(self.n, -1))
        return out

    @torch.no_grad()
    def pack_reference(self, tensors: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """Slow twin of ``pack``: one copy per (rank, parameter)."""
        grid = out.view(self.n, self.shard_numel)  # (N, S)
        for i, t in enumerate(tensors):
            t2 = t.reshape(self.d0[i], self.cols[i])  # (d0, c)
            r, c, o = self.rows[i], self.cols[i], self.offsets[i]
            for k in range(self.n):
                rows = t2[k * r:(k + 1) * r]  # (<= r, c)
                grid[k, o:o + rows.numel()].copy_(rows.reshape(-1))
                grid[k, o + rows.numel():o + r * c].zero_()  # padding
        return out

    @torch.no_grad()
    def unpack(self, gathered: torch.Tensor, outs: list[torch.Tensor]) -> None:
        """All-gather output (N * S,) -> full tensors ``outs[i]`` (shape ``shapes[i]``), padding dropped."""
        grid = gathered.view(self.n, self.shard_numel)  # (N, S)
        pieces = torch.split(grid, self.sizes, dim=1)  # (N, s_i) each
        for i, (piece, out) in enumerate(zip(pieces, outs)):
            d0, r, c = self.d0[i], self.rows[i], self.cols[i]
            if d0 == self.n * r:
                out.view(self.n, r * c).copy_(piece)
            else:
                out.view(d0, c).copy_(piece.reshape(self.n * r, c)[:d0])  # (N r, c) -> (d0, c)
