"""Expert parallel collectives: the variable-size all-to-all of MoE dispatch and combine (GShard,
Lepikhin et al. 2020), counted as bytes sent to other ranks. Backward all-to-alls always run on the
``ep`` twin (``backward_group``), so DualPipeV's threaded pairs never share a process group."""
from __future__ import annotations

import math
import threading

import torch
import torch.distributed as dist

from ndtrain.mesh import AxisGroup
from ndtrain.parallel.comm import count
from ndtrain.parallel.flight_recorder import run_collective

_TALLY_LOCK = threading.Lock()  # a pair's forward and backward threads may both add to a tally


def backward_group(group: AxisGroup) -> AxisGroup:
    """``group.bwd`` when the mesh built a twin (``ep`` with ep > 1), else ``group``."""
    return group.bwd if group.bwd is not None else group


def add_tally(tally, nbytes: float) -> None:
    """``tally.a2a_bytes += nbytes`` under a lock (None: nothing)."""
    if tally is not None:
        with _TALLY_LOCK:
            tally.a2a_bytes += nbytes


class PendingAllToAll:
    """An all-to-all in flight: its ``TimedWork`` (None for a size-1 group) and the send buffer kept alive."""

    def __init__(self):
        self.work = None
        self.send: torch.Tensor | None = None

    def wait(self) -> None:
        """Block until the all-to-all has filled its output (under the flight recorder's deadline)."""
        if self.work is not None:
            self.work.wait()
        self.work, self.send = None, None


def start_all_to_all_v(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                       group: AxisGroup, tally=None) -> PendingAllToAll:
    """Start ``all_to_all_v``; ``out`` is valid after ``wait()``. Bytes are counted at the start."""
    pending = PendingAllToAll()
    if group.pg is None:
        out.copy_(inp)
        return pending
    row = math.prod(inp.shape[1:]) * inp.element_size()  # bytes per row (inp may have 0 rows)
    b = (sum(in_splits) - in_splits[group.rank]) * row
    count(group, b)
    add_tally(tally, b)
    send = pending.send = inp.contiguous()
    pending.work = run_collective("all_to_all_v", group, b, lambda: dist.all_to_all_single(
        out, send, out_splits, in_splits, group=group.pg, async_op=True), True)
    return pending


def all_to_all_v(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                 group: AxisGroup, tally=None) -> None:
    """``out`` <- rows from every rank: send ``inp`` rows by ``in_splits`` (per destination, rank order),
    receive ``out_splits[s]`` from rank s, stacked in rank order. Counts the bytes sent to other ranks
    ((N-1)/N * S for an even split), also into ``tally.a2a_bytes`` when given. Size-1 group: a copy."""
    start_all_to_all_v(out, inp, out_splits, in_splits, group, tally).wait()


class AllToAllV(torch.autograd.Function):
    """Variable rows to every rank of ``group`` (MoE dispatch and combine): x (sum(in_splits), ...) ->
    (sum(out_splits), ...). fwd: all-to-all; bwd: the reverse one on ``backward_group(group)``. Both
    count on the axis and into ``tally``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: AxisGroup,
                tally=None):
        ctx.splits, ctx.group, ctx.tally = (out_splits, in_splits), group, tally
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        all_to_all_v(out, x, out_splits, in_splits, group, tally)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        out_splits, in_splits = ctx.splits
        gx = g.new_empty((sum(in_splits),) + tuple(g.shape[1:]))
        all_to_all_v(gx, g.contiguous(), in_splits, out_splits, backward_group(ctx.group), ctx.tally)
        return gx, None, None, None, None
