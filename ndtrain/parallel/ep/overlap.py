"""Shared-expert overlap of the expert-parallel dispatch (Megatron-Core's ``moe_shared_expert_overlap``).

Under expert parallel the dispatch all-to-all of an MoE layer's routed tokens and the layer's
shared expert(s) are independent: the shared expert reads the layer input, the all-to-all moves
the routed copies of it. ``parallel.moe_shared_overlap`` starts the dispatch asynchronously
(``DispatchStart``), runs the shared expert (and the Qwen3-Next shared gate) while it is in
flight, then waits (``Wait``) before the local experts read the received rows.

The work done is the same -- the same ops on the same tensors -- only the order of independent
work changes, so the results are bitwise those of the synchronous path, gradients included (the
gradient of the layer input is still summed in the same order, see ``MoE.forward_tokens``).

Backward stays synchronous: ``DispatchStart``'s backward is ``AllToAllV``'s (the reverse
all-to-all, on the ``ep`` group's backward twin), issued when autograd reaches it; ``Wait``'s
backward is the identity.
"""
from __future__ import annotations

import torch

from ndtrain.mesh import AxisGroup
from ndtrain.parallel.ep.collectives import AllToAllV, PendingAllToAll, start_all_to_all_v


class DispatchStart(torch.autograd.Function):
    """Start the dispatch all-to-all: x (sum(in_splits), C) -> a (sum(out_splits), C) buffer that
    the all-to-all is still filling; ``handle`` (a fresh ``PendingAllToAll``) receives the work.
    Read the buffer only through ``Wait.apply(buf, handle)``.

    Backward: the synchronous reverse all-to-all of the gradient, by ``AllToAllV.backward`` itself
    (same ``ctx`` fields), so it runs on the same group (the ``ep`` backward twin) and counts the
    same bytes.
    """

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
    """The dispatch all-to-all of ``xs`` (M, C) with ``side_fn()`` run while it is in flight.
    Returns (received rows (R, C) in (source, expert) order, ``side_fn()``'s result)."""
    handle = PendingAllToAll()
    buf = DispatchStart.apply(xs, out_splits, in_splits, group, tally, handle)
    try:
        side = side_fn()
    finally:  # never leave a collective un-waited (a failing side_fn would desynchronise later ones)
        handle.wait()
    return Wait.apply(buf, handle), side
