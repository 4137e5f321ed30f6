"""Expert parallel collectives: the variable-size all-to-all of MoE token dispatch and combine
(GShard, Lepikhin et al. 2020), counted as the bytes a rank sends to other ranks.

Backward all-to-alls run on the ``ep`` group's twin (``backward_group``: same ranks, its own
process group, ``ndtrain.mesh``), always, so DualPipeV's overlapped pairs (``parallel.pp_overlap``,
``ndtrain.parallel.pp.runtime``) can run one microbatch's backward in a worker thread while the main
thread runs another's forward: each process group then sees its collectives in the schedule's
order on every ep rank (ep peers share the pp rank, hence the action sequence).
"""
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
    """The group a backward collective of ``group`` runs on: its twin ``group.bwd`` when the mesh
    built one (``ep`` with ep > 1), else ``group`` itself."""
    return group.bwd if group.bwd is not None else group


def add_tally(tally, nbytes: float) -> None:
    """``tally.a2a_bytes += nbytes`` under a lock (None: nothing)."""
    if tally is not None:
        with _TALLY_LOCK:
            tally.a2a_bytes += nbytes


class PendingAllToAll:
    """An all-to-all in flight: the recorder's ``TimedWork`` (None for a size-1 group, already
    done) and the send buffer, kept alive until ``wait``."""

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
    """Start ``all_to_all_v`` asynchronously: ``out`` is valid after the returned handle's
    ``wait()``. The bytes are counted at the start (axis, flight recorder, ``tally``)."""
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
    """``out`` <- rows from every rank: rank r sends ``inp`` rows ``in_splits`` (one count per
    destination, in rank order) and receives ``out_splits[s]`` rows from rank s, stacked in rank order.

    Counted as the bytes this rank actually sends to *other* ranks (its own chunk stays local),
    which for an even split is the ring-cost ``(N-1)/N * S``. Size-1 group: ``out.copy_(inp)``.
    ``tally``: optional object whose ``a2a_bytes`` also receives those bytes (an MoE layer's
    ``LoadStats``, for the per-step ``moe_a2a_bytes`` metric).
    """
    start_all_to_all_v(out, inp, out_splits, in_splits, group, tally).wait()


class AllToAllV(torch.autograd.Function):
    """Send variable numbers of rows to every rank of ``group`` (MoE dispatch and combine).

    fwd: variable all-to-all with (out_splits, in_splits), bwd: the reverse all-to-all
    (in_splits, out_splits) of the gradient, on ``backward_group(group)`` (the ``ep`` twin).
    x (sum(in_splits), ...) -> (sum(out_splits), ...). Both directions add their bytes to
    ``tally`` (see ``all_to_all_v``) when given, and count them on the group's axis.
    """

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
