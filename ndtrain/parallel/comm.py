"""Every collective ndtrain issues, each taking an explicit ``AxisGroup`` and counting its bytes.

Byte counts are the bytes *this rank sends* under the bandwidth-optimal ring algorithm, so logged
traffic can be compared with the textbook costs (Patarasuk & Yuan 2009; ZeRO, Rajbhandari 2020):

* all-reduce of S bytes over N ranks: 2 (N-1)/N * S
* all-gather producing S bytes:        (N-1)/N * S
* reduce-scatter consuming S bytes:    (N-1)/N * S
* all-to-all of S bytes (even split):  (N-1)/N * S
* send of S bytes:                      S

A size-1 group (``pg is None``) makes every function a no-op that counts nothing. Functions that
take part in autograd are classes named for their forward effect with "fwd: X, bwd: Y" docstrings
(Megatron-LM's f / g operators, Shoeybi et al. 2019); they are added by the axes that need them.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ndtrain.mesh import AxisGroup


# torch 2.13 renamed the flat-tensor collectives (the old names warn); older releases lack the new ones.
_ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def count(group: AxisGroup, nbytes: float) -> None:
    group.stats[group.name] = group.stats.get(group.name, 0.0) + nbytes


def all_reduce(t: torch.Tensor, group: AxisGroup, op=dist.ReduceOp.SUM, async_op: bool = False):
    """In-place all-reduce of ``t`` over ``group``; returns a Work handle when ``async_op``."""
    if group.pg is None:
        return None
    n = group.size
    count(group, 2 * (n - 1) / n * _nbytes(t))
    return dist.all_reduce(t, op=op, group=group.pg, async_op=async_op)


def all_gather_into(out: torch.Tensor, shard: torch.Tensor, group: AxisGroup, async_op: bool = False):
    """``out`` (N*S,) <- concatenation over ranks of ``shard`` (S,); rank order along dim 0."""
    if group.pg is None:
        out.copy_(shard)
        return None
    n = group.size
    count(group, (n - 1) / n * _nbytes(out))
    return _ALL_GATHER(out, shard, group=group.pg, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, full: torch.Tensor, group: AxisGroup,
                        op=dist.ReduceOp.SUM, async_op: bool = False):
    """``out`` (S,) <- this rank's slice of the sum over ranks of ``full`` (N*S,)."""
    if group.pg is None:
        out.copy_(full)
        return None
    n = group.size
    count(group, (n - 1) / n * _nbytes(full))
    return _REDUCE_SCATTER(out, full, op=op, group=group.pg, async_op=async_op)


def broadcast(t: torch.Tensor, group: AxisGroup, src_local_rank: int = 0) -> None:
    """In-place broadcast from the group's ``src_local_rank``; counted as S bytes on the source."""
    if group.pg is None:
        return
    if group.rank == src_local_rank:
        count(group, _nbytes(t))
    dist.broadcast(t, group=group.pg, group_src=src_local_rank)


def all_reduce_scalar(value: float, group: AxisGroup, dtype=torch.float64,
                      op=dist.ReduceOp.SUM, device: torch.device | str = "cpu") -> float:
    """Sum (or ``op``) a Python scalar over the group; a convenience for counts and norms."""
    t = torch.tensor([value], dtype=dtype, device=device)
    all_reduce(t, group, op=op)
    return t.item()


# --- autograd-aware collectives for tensor / sequence / context parallel (Megatron f / g) ---
def _gather_dim(x: torch.Tensor, dim: int, group: AxisGroup) -> torch.Tensor:
    """Concatenate ``x`` over the group's ranks along ``dim`` (rank order); counted as all-gather."""
    xs = x.movedim(dim, 0).contiguous()  # (S, ...) with the gathered dim first
    out = xs.new_empty((group.size * xs.shape[0],) + tuple(xs.shape[1:]))
    all_gather_into(out, xs, group)
    return out.movedim(0, dim)


def _reduce_scatter_dim(x: torch.Tensor, dim: int, group: AxisGroup) -> torch.Tensor:
    """This rank's ``1/N`` slice along ``dim`` of the sum of ``x`` over ranks; counted as reduce-scatter."""
    if x.shape[dim] % group.size:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} is not divisible by {group.name} ({group.size})")
    xs = x.movedim(dim, 0).contiguous()  # (N*S, ...)
    out = xs.new_empty((xs.shape[0] // group.size,) + tuple(xs.shape[1:]))
    reduce_scatter_into(out, xs, group)
    return out.movedim(0, dim)


def _split_dim(x: torch.Tensor, dim: int, group: AxisGroup) -> torch.Tensor:
    if x.shape[dim] % group.size:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} is not divisible by {group.name} ({group.size})")
    return x.chunk(group.size, dim)[group.rank].contiguous()


class CopyToTP(torch.autograd.Function):
    """Megatron's f operator: enter a tensor-parallel region with a replicated input.

    fwd: identity, bwd: all-reduce (sum) over ``group``.
    Also applied to weights that every rank of ``group`` holds whole but uses on different data
    (norm gains under sequence parallel, replicated kv heads), so their gradients are summed.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        g = g.contiguous().clone()
        all_reduce(g, ctx.group)
        return g, None


class ReduceFromTP(torch.autograd.Function):
    """Megatron's g operator: leave a tensor-parallel region by summing partial outputs.

    fwd: all-reduce (sum) over ``group``, bwd: identity.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
        x = x.contiguous().clone()
        all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g, None


class ScatterToSequence(torch.autograd.Function):
    """Keep this rank's 1/N slice of a replicated tensor along ``dim`` (sequence parallel entry).

    fwd: split along ``dim`` (no communication), bwd: all-gather along ``dim``.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: AxisGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _split_dim(x, dim, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _gather_dim(g, ctx.dim, ctx.group), None, None


class GatherFromSequence(torch.autograd.Function):
    """Sequence-sharded -> full sequence before a tensor-parallel region (Korthikanti 2022, g-bar).

    fwd: all-gather along ``dim``, bwd: reduce-scatter along ``dim`` (the region's partial input
    gradients are summed and each rank keeps its own sequence slice).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: AxisGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _gather_dim(x, dim, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _reduce_scatter_dim(g, ctx.dim, ctx.group), None, None


class ReduceScatterToSequence(torch.autograd.Function):
    """Partial sums of a tensor-parallel region -> summed, sequence-sharded (Korthikanti 2022).

    fwd: reduce-scatter along ``dim``, bwd: all-gather along ``dim``.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: AxisGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter_dim(x, dim, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _gather_dim(g, ctx.dim, ctx.group), None, None


def _all_to_all(x: torch.Tensor, group: AxisGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    n = group.size
    if x.shape[scatter_dim] % n:
        raise ValueError(f"all-to-all: dim {scatter_dim} of size {x.shape[scatter_dim]} is not "
                         f"divisible by {group.name} ({n})")
    send = torch.stack(x.chunk(n, scatter_dim)).contiguous()  # (N, ...) chunk i goes to rank i
    recv = torch.empty_like(send)
    count(group, (n - 1) / n * _nbytes(send))
    dist.all_to_all_single(recv, send, group=group.pg)
    return torch.cat(recv.unbind(0), dim=gather_dim)  # chunks from ranks 0..N-1 in order


class AllToAll(torch.autograd.Function):
    """Re-shard a tensor from ``gather_dim`` to ``scatter_dim`` (DeepSpeed-Ulysses, Jacobs 2023).

    Each rank splits ``x`` into N chunks along ``scatter_dim``, sends chunk i to rank i, and
    concatenates what it receives along ``gather_dim`` in rank order.
    fwd: all-to-all (scatter ``scatter_dim``, gather ``gather_dim``), bwd: the inverse all-to-all.
    Bytes: (N-1)/N * S per rank each way.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: AxisGroup, scatter_dim: int, gather_dim: int):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        if group.pg is None:
            return x.view_as(x)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        if ctx.group.pg is None:
            return g, None, None, None
        s, gd = ctx.dims
        return _all_to_all(g.contiguous(), ctx.group, gd, s), None, None, None


def ring_exchange(send: torch.Tensor, group: AxisGroup, tag: int = 0):
    """Start sending ``send`` to the next rank of the ring and receiving the previous rank's.

    Returns ``(recv, works)``: ``recv`` is valid after every handle in ``works`` has been waited
    on, so the caller can compute while the transfer runs (ring attention, Liu et al. 2023).
    Counted as ``send``'s bytes on ``group``. Raises ValueError on a size-1 group.
    """
    if group.pg is None:
        raise ValueError("ring_exchange needs a group of size > 1")
    send = send.contiguous()
    recv = torch.empty_like(send)
    nxt, prv = (group.rank + 1) % group.size, (group.rank - 1) % group.size
    ops = [dist.P2POp(dist.isend, send, group=group.pg, tag=tag, group_peer=nxt),
           dist.P2POp(dist.irecv, recv, group=group.pg, tag=tag, group_peer=prv)]
    count(group, _nbytes(send))
    return recv, dist.batch_isend_irecv(ops)


# --- variable-size all-to-all for expert parallel (MoE token dispatch / combine) ---
def all_to_all_v(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                 group: AxisGroup) -> None:
    """``out`` <- rows from every rank: rank r sends ``inp`` rows ``in_splits`` (one count per
    destination, in rank order) and receives ``out_splits[s]`` rows from rank s, stacked in rank order.

    Counted as the bytes this rank actually sends to *other* ranks (its own chunk stays local),
    which for an even split is the ring-cost ``(N-1)/N * S``. Size-1 group: ``out.copy_(inp)``.
    """
    if group.pg is None:
        out.copy_(inp)
        return
    row = math.prod(inp.shape[1:]) * inp.element_size()  # bytes per row (inp may have 0 rows)
    count(group, (sum(in_splits) - in_splits[group.rank]) * row)
    dist.all_to_all_single(out, inp.contiguous(), out_splits, in_splits, group=group.pg)


class AllToAllV(torch.autograd.Function):
    """Send variable numbers of rows to every rank of ``group`` (MoE dispatch and combine).

    fwd: variable all-to-all with (out_splits, in_splits), bwd: the reverse all-to-all
    (in_splits, out_splits) of the gradient. x (sum(in_splits), ...) -> (sum(out_splits), ...).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: AxisGroup):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        all_to_all_v(out, x, out_splits, in_splits, group)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        out_splits, in_splits = ctx.splits
        gx = g.new_empty((sum(in_splits),) + tuple(g.shape[1:]))
        all_to_all_v(gx, g.contiguous(), in_splits, out_splits, ctx.group)
        return gx, None, None, None


# --- pipeline parallel: point-to-point between stages (counted as sends: S bytes on the sender) ---
def send_async(t: torch.Tensor, group: AxisGroup, dst_local_rank: int, tag: int = 0):
    """Post an asynchronous send of ``t`` to the group's ``dst_local_rank``; returns the Work.

    ``t`` must stay alive and unmodified until the Work completes. Counted: S bytes on the sender.
    Raises RuntimeError on a size-1 group (a pipeline stage never sends to itself).
    """
    if group.pg is None:
        raise RuntimeError(f"send on size-1 group {group.name!r}")
    count(group, _nbytes(t))
    return dist.isend(t.contiguous(), group=group.pg, group_dst=dst_local_rank, tag=tag)


def recv_async(t: torch.Tensor, group: AxisGroup, src_local_rank: int, tag: int = 0):
    """Post an asynchronous receive into ``t`` (preallocated, exact size and dtype) from the group's
    ``src_local_rank``; returns the Work. Not counted (the sender counts the bytes)."""
    if group.pg is None:
        raise RuntimeError(f"recv on size-1 group {group.name!r}")
    return dist.irecv(t, group=group.pg, group_src=src_local_rank, tag=tag)


def all_gather_object(obj, group: AxisGroup) -> list:
    """Every rank's picklable ``obj``, in group-rank order (for timelines and diagnostics, not for
    tensors on the training path). Counted as an all-gather of the pickled size times N."""
    if group.pg is None:
        return [obj]
    import pickle

    out = [None] * group.size
    count(group, (group.size - 1) * len(pickle.dumps(obj)))
    dist.all_gather_object(out, obj, group=group.pg)
    return out
