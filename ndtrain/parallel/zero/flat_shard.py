"""Padded row sharding of a group of parameters into one flat buffer (ZeRO / FSDP;
docs/sharded_data_parallel.md, "The layout").

    parameter i: shape s_i, sharded along dim d_i (0, or 1 for a tensor of >= 3 dims whose dim 0 is
    shorter than N: E/ep local experts over more ranks, torchtitan's rule for experts)
    row = one index of dim d_i: d0_i rows of c_i = numel / d0_i elements (the other dims, in order)
    rows per shard r_i = ceil(d0_i / N), padded shard size s_i = r_i * c_i, offset o_i = sum_{j<i} s_j
    flat shard (S,), S = sum_i s_i; the gathered buffer (N * S,) viewed (N, S) holds rank k's shard
    in row k, so parameter i's rows k*r_i .. (k+1)*r_i - 1 are columns [o_i, o_i + s_i) of row k.

A shard is stored row-first, ``(r_i, *other dims)`` (``shard_shape``), so padding and the valid
rows are leading rows whatever d_i is; ``natural`` shows it in the parameter's own dim order.
``torch.chunk`` / DTensor ``Shard(d_i)`` semantics, so checkpoints load under any layout. Padding
is real traffic (``comm`` counts it). A 0-d parameter is one row of one element, an empty one takes
no space. ``pack`` (``torch._chunk_cat``) has the slow twin ``pack_reference``."""
from __future__ import annotations

import math

import torch


def shard_dim(shape: torch.Size, n: int) -> int:
    """The dim a parameter of ``shape`` is sharded along over ``n`` ranks: 0, or 1 when dim 0 has
    fewer rows than ranks, dim 1 more, and a third dim exists (the expert weights (E, F, C) /
    (E, C, F): rows of whole experts would leave ranks holding only padding)."""
    return 1 if len(shape) >= 3 and shape[0] < n and shape[1] > shape[0] else 0


class FlatShardLayout:
    """The padded layout of ``shapes`` over ``n`` ranks, seen from ``rank``.

    Attributes: ``dims[i]`` (d_i), ``d0[i]`` (rows: the size of dim d_i; 1 for 0-d), ``cols[i]``
    (c_i), ``rows[i]`` (r_i), ``sizes[i]`` (s_i), ``offsets[i]`` (o_i), ``shard_numel`` (S),
    ``valid_rows[i]`` (rows really held, 0 .. r_i). Raises ValueError for ``n`` < 1 or ``rank``
    outside [0, n)."""

    def __init__(self, shapes: list[torch.Size], n: int, rank: int):
        if n < 1 or not 0 <= rank < n:
            raise ValueError(f"rank ({rank}) must be in [0, n={n})")
        self.shapes = [torch.Size(s) for s in shapes]
        self.n, self.rank = n, rank
        self.dims = [shard_dim(s, n) for s in self.shapes]
        self.d0, self.rows, self.sizes, self.offsets, self.valid_rows, self.cols = [], [], [], [], [], []
        off = 0
        for s, d in zip(self.shapes, self.dims):
            d0 = s[d] if len(s) else 1  # a scalar is one row of one
            c = math.prod(s) // d0 if d0 else math.prod(s[:d] + s[d + 1:])
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

    def shard_shape(self, i: int, rows: int | None = None) -> torch.Size:
        """Parameter ``i``'s shard, row-first: ``(rows (default r_i), *other dims)``."""
        s, d = self.shapes[i], self.dims[i]
        return torch.Size((self.rows[i] if rows is None else rows, *s[:d], *s[d + 1:]))

    def row_range(self, i: int) -> tuple[int, int]:
        """Global rows [lo, hi) of parameter ``i`` (indices of dim d_i) held by this rank."""
        lo = min(self.rank * self.rows[i], self.d0[i])
        return lo, lo + self.valid_rows[i]

    def rows_of(self, full: torch.Tensor, i: int) -> torch.Tensor:
        """A full tensor of parameter ``i`` seen row-first, ``(d0_i, *other dims)``: a view."""
        return full.reshape(1) if full.dim() == 0 else full.movedim(self.dims[i], 0)

    def natural(self, shard: torch.Tensor, i: int) -> torch.Tensor:
        """A row-first shard (or its valid rows) in the parameter's dim order: a view (the DTensor
        local of ``Shard(d_i)``)."""
        return shard.movedim(0, self.dims[i]) if len(self.shapes[i]) else shard

    def shard_view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s padded shard inside a flat shard (S,): a ``shard_shape(i)`` view."""
        o = self.offsets[i]
        return self.block_view(flat[o:o + self.sizes[i]], i)

    def block_view(self, block: torch.Tensor, i: int) -> torch.Tensor:
        """One shard's s_i elements of parameter ``i`` (contiguous) as ``shard_shape(i)``."""
        return block.view(self.shard_shape(i))

    def valid_view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """The unpadded rows of parameter ``i`` in a flat shard: (valid_rows_i, *other dims) view."""
        return self.shard_view(flat, i)[: self.valid_rows[i]]

    @torch.no_grad()
    def shard_from_full(self, fulls: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """Write this rank's rows of each full tensor into ``out`` (S,), padding with zeros."""
        out.zero_()
        for i, full in enumerate(fulls):
            lo, hi = self.row_range(i)
            self.valid_view(out, i).copy_(self.rows_of(full, i)[lo:hi])
        return out

    @torch.no_grad()
    def pack(self, tensors: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """Reduce-scatter input: full tensors (``shapes[i]``) -> ``out`` (N * S,), padded. A dtype differing
        from ``out``'s, or a parameter sharded along dim 1, takes ``pack_reference`` (copies, no
        intermediate tensors)."""
        if any(t.dtype != out.dtype for t in tensors) or any(self.dims):
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
            t2 = self.rows_of(t, i)  # (d0, *other dims)
            r, c, o = self.rows[i], self.cols[i], self.offsets[i]
            for k in range(self.n):
                rows = t2[k * r:(k + 1) * r]  # (<= r, *other dims)
                m = rows.shape[0]
                if m:
                    grid[k, o:o + m * c].view(rows.shape).copy_(rows)
                grid[k, o + m * c:o + r * c].zero_()  # padding
        return out

    @torch.no_grad()
    def unpack(self, gathered: torch.Tensor, outs: list[torch.Tensor]) -> None:
        """All-gather output (N * S,) -> full tensors ``outs[i]`` (shape ``shapes[i]``), padding dropped."""
        grid = gathered.view(self.n, self.shard_numel)  # (N, S)
        pieces = torch.split(grid, self.sizes, dim=1)  # (N, s_i) each
        for i, (piece, out) in enumerate(zip(pieces, outs)):
            d0, r, c = self.d0[i], self.rows[i], self.cols[i]
            if self.dims[i]:
                self._unpack_moved(piece, out, i)
            elif d0 == self.n * r:
                out.view(self.n, r * c).copy_(piece)
            else:
                out.view(d0, c).copy_(piece.reshape(self.n * r, c)[:d0])  # (N r, c) -> (d0, c)

    def _unpack_moved(self, piece: torch.Tensor, out: torch.Tensor, i: int) -> None:
        """``unpack`` of a parameter sharded along dim 1: rank k's block into rows k r .. of ``out``."""
        dst, r = self.rows_of(out, i), self.rows[i]  # (d0, *other dims), a strided view of out
        other = self.shard_shape(i)[1:]
        if self.d0[i] == self.n * r:
            dst.unflatten(0, (self.n, r)).copy_(piece.reshape(self.n, r, *other))
            return
        for k in range(self.n):
            m = max(0, min(r, self.d0[i] - k * r))
            if m:
                dst[k * r:k * r + m].copy_(piece[k, :m * self.cols[i]].view(m, *other))

    def assemble(self, piece: torch.Tensor, i: int) -> torch.Tensor:
        """Every rank's block of parameter ``i``, (N, s_i), -> the full tensor (``shapes[i]``), new."""
        out = piece.new_empty(self.shapes[i])
        FlatShardLayout([self.shapes[i]], self.n, 0).unpack(piece.reshape(-1), [out])
        return out

    def split(self, full: torch.Tensor, i: int) -> torch.Tensor:
        """The full tensor of parameter ``i`` -> every rank's padded block, (N, s_i), new."""
        out = full.new_empty(self.n, self.sizes[i])
        FlatShardLayout([self.shapes[i]], self.n, 0).pack_reference([full], out.view(-1))
        return out
