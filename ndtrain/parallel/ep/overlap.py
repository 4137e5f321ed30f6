"""Shared-expert overlap of the ep dispatch (Megatron-Core's ``moe_shared_expert_overlap``).

The dispatch moves routed copies of the layer input while the shared expert reads the input
itself, so ``parallel.moe_shared_overlap`` starts the dispatch (``DispatchStart``), runs the shared
expert (and Qwen3-Next's gate), then waits (``Wait``). Same ops on the same tensors: bitwise the
synchronous path, gradients included. Backward stays synchronous (``AllToAllV``'s reverse
all-to-all on the ep twin; ``Wait``'s backward is the identity)."""
from __future__ import annotations

import torch

from ndtrain.mesh import AxisGroup
from ndtrain.parallel.ep.collectives import AllToAllV, PendingAllToAll, start_all_to_all_v


class DispatchStart(torch.autograd.Function):
    """x (sum(in_splits), C) -> a (sum(out_splits), C) buffer still being filled; ``handle`` receives the
    work. Read it only through ``Wait.apply(buf, handle)``. bwd: ``AllToAllV.backward`` (same group,
    same bytes)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: AxisGroup,
                tally, handle: PendingAllToAll):
        ctx.splits, ctx.group, ctx.tally = (out_splits, in_splits), group, tally
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        started = start_all_to_all_v(out, x, out_splits, in_splits, group, tally)
        handle.work, handle.send = started.work, started.send
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return AllToAllV.backward(ctx, g)[0], None, None, None, None, None


class Wait(torch.autograd.Function):
    """Wait for ``handle`` and return its filled buffer (as a view); backward: the identity."""

    @staticmethod
    def forward(ctx, buf: torch.Tensor, handle: PendingAllToAll) -> torch.Tensor:
        handle.wait()
        return buf.view_as(buf)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g, None


def dispatch_overlapped(xs: torch.Tensor, out_splits: list[int], in_splits: list[int], group: AxisGroup,
                        tally, side_fn) -> tuple[torch.Tensor, object]:
    """Dispatch ``xs`` (M, C) with ``side_fn()`` run meanwhile -> (rows (R, C) in (source, expert) order,
    its result)."""
    handle = PendingAllToAll()
    buf = DispatchStart.apply(xs, out_splits, in_splits, group, tally, handle)
    try:
        side = side_fn()
    finally:  # never leave a collective un-waited (a failing side_fn would desynchronise later ones)
        handle.wait()
    return Wait.apply(buf, handle), side
