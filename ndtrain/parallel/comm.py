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
    return dist.all_gather_into_tensor(out, shard, group=group.pg, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, full: torch.Tensor, group: AxisGroup,
                        op=dist.ReduceOp.SUM, async_op: bool = False):
    """``out`` (S,) <- this rank's slice of the sum over ranks of ``full`` (N*S,)."""
    if group.pg is None:
        out.copy_(full)
        return None
    n = group.size
    count(group, (n - 1) / n * _nbytes(full))
    return dist.reduce_scatter_tensor(out, full, op=op, group=group.pg, async_op=async_op)


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
