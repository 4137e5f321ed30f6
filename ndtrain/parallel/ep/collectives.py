"""Expert parallel collectives: the variable-size all-to-all of MoE token dispatch and combine
(GShard, Lepikhin et al. 2020), counted as the bytes a rank sends to other ranks.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ndtrain.mesh import AxisGroup
from ndtrain.parallel.comm import count
from ndtrain.parallel.flight_recorder import run_collective


def all_to_all_v(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                 group: AxisGroup, tally=None) -> None:
    """``out`` <- rows from every rank: rank r sends ``inp`` rows ``in_splits`` (one count per
    destination, in rank order) and receives ``out_splits[s]`` rows from rank s, stacked in rank order.

    Counted as the bytes this rank actually sends to *other* ranks (its own chunk stays local),
    which for an even split is the ring-cost ``(N-1)/N * S``. Size-1 group: ``out.copy_(inp)``.
    ``tally``: optional object whose ``a2a_bytes`` also receives those bytes (an MoE layer's
    ``LoadStats``, for the per-step ``moe_a2a_bytes`` metric).
    """
    if group.pg is None:
        out.copy_(inp)
        return
    row = math.prod(inp.shape[1:]) * inp.element_size()  # bytes per row (inp may have 0 rows)
    b = (sum(in_splits) - in_splits[group.rank]) * row
    count(group, b)
    if tally is not None:
        tally.a2a_bytes += b
    inp = inp.contiguous()
    run_collective("all_to_all_v", group, b, lambda: dist.all_to_all_single(
        out, inp, out_splits, in_splits, group=group.pg, async_op=True), False)


class AllToAllV(torch.autograd.Function):
    """Send variable numbers of rows to every rank of ``group`` (MoE dispatch and combine).

    fwd: variable all-to-all with (out_splits, in_splits), bwd: the reverse all-to-all
    (in_splits, out_splits) of the gradient. x (sum(in_splits), ...) -> (sum(out_splits), ...).
    Both directions add their bytes to ``tally`` (see ``all_to_all_v``) when given.
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
        all_to_all_v(gx, g.contiguous(), in_splits, out_splits, ctx.group, ctx.tally)
        return gx, None, None, None, None
