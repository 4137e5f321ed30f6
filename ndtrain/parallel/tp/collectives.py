"""Tensor / sequence parallel autograd collectives: Megatron-LM's f and g (Shoeybi et al. 2019) and
the sequence-parallel all-gather / reduce-scatter pair (Korthikanti et al. 2022).

Each class is named for its forward effect; its docstring says "fwd: X, bwd: Y". Bytes are counted
on the group's axis by the primitives of ``ndtrain.parallel.comm``.

Which collectives reduce *weight* gradients: only ``CopyWeightToTP`` (norm gains under SP,
replicated kv weights); it honours ``parallel.grad_reduce_dtype`` like the data-parallel
reductions do. The others move *activations* or their gradients, which stay in the compute dtype
(as in Megatron-LM): they are part of the forward / backward computation, not of the gradient sync.
"""
from __future__ import annotations

import torch

from ndtrain.mesh import AxisGroup
from ndtrain.parallel.comm import all_reduce, gather_dim, reduce_scatter_dim, split_dim


class CopyToTP(torch.autograd.Function):
    """Megatron's f operator: enter a tensor-parallel region with a replicated input.

    fwd: identity, bwd: all-reduce (sum) over ``group``, in the gradient's dtype (an activation
    gradient; weights use ``CopyWeightToTP``).
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


class _AdjointPair(torch.autograd.Function):
    """``fwd(x, dim, group)`` in forward, its adjoint ``bwd(g, dim, group)`` in backward. The four
    sequence reshards below are two such pairs: all-gather / reduce-scatter (partial-sum gradients)
    and split / all-gather (replicated gradients)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: AxisGroup, dim: int, fwd, bwd) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.bwd = group, dim, bwd
        return fwd(x, dim, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return ctx.bwd(g, ctx.dim, ctx.group), None, None, None, None


class GatherFromSequence:
    """Sequence-sharded -> full sequence before a tensor-parallel region (Korthikanti 2022, g-bar).

    fwd: all-gather along ``dim``, bwd: reduce-scatter along ``dim`` (the region's partial input
    gradients are summed and each rank keeps its own sequence slice).
    """

    @staticmethod
    def apply(x: torch.Tensor, group: AxisGroup, dim: int) -> torch.Tensor:
        return _AdjointPair.apply(x, group, dim, gather_dim, reduce_scatter_dim)


class ReduceScatterToSequence:
    """Partial sums of a tensor-parallel region -> summed, sequence-sharded (Korthikanti 2022).

    fwd: reduce-scatter along ``dim``, bwd: all-gather along ``dim``.
    """

    @staticmethod
    def apply(x: torch.Tensor, group: AxisGroup, dim: int) -> torch.Tensor:
        return _AdjointPair.apply(x, group, dim, reduce_scatter_dim, gather_dim)


class ScatterToSequence:
    """Replicated input -> this rank's 1/tp slice along ``dim`` (Megatron's scatter-to-sequence-
    parallel region; the MoE layer under tp without SP routes only its own tokens).

    fwd: split along ``dim`` (no communication), bwd: all-gather along ``dim``.
    """

    @staticmethod
    def apply(x: torch.Tensor, group: AxisGroup, dim: int) -> torch.Tensor:
        return _AdjointPair.apply(x, group, dim, split_dim, gather_dim)


class GatherToReplicated:
    """This rank's slice -> the whole tensor on every rank, whose gradient arrives replicated
    (Megatron's gather-from-sequence-parallel region without a tensor-parallel output gradient).

    fwd: all-gather along ``dim``, bwd: split along ``dim`` (no communication).
    """

    @staticmethod
    def apply(x: torch.Tensor, group: AxisGroup, dim: int) -> torch.Tensor:
        return _AdjointPair.apply(x, group, dim, gather_dim, split_dim)


def all_reduce_grad(g: torch.Tensor, group: AxisGroup, reduce_dtype: torch.dtype | None) -> torch.Tensor:
    """Sum of the weight gradient ``g`` over ``group``, reduced in ``reduce_dtype`` (None: g's own
    dtype) and returned, as a new tensor, in g's dtype (one rounding after an exact-dtype sum)."""
    buf = g.to(dtype=reduce_dtype or g.dtype, memory_format=torch.contiguous_format, copy=True)
    all_reduce(buf, group)
    return buf.to(g.dtype)


class CopyWeightToTP(torch.autograd.Function):
    """Megatron's f on a weight that every rank of ``group`` holds whole but uses on different
    data (norm gains under sequence parallel, replicated kv heads): its gradient is summed.

    fwd: identity, bwd: all-reduce (sum) over ``group`` in ``reduce_dtype``
    (``parallel.grad_reduce_dtype`` under mixed precision; None: the gradient's dtype), cast back
    to the gradient's dtype. Bytes: 2 (N-1)/N * numel * size of ``reduce_dtype``.
    """

    @staticmethod
    def forward(ctx, w: torch.Tensor, group: AxisGroup, reduce_dtype: torch.dtype | None) -> torch.Tensor:
        ctx.group, ctx.reduce_dtype = group, reduce_dtype
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return all_reduce_grad(g, ctx.group, ctx.reduce_dtype), None, None
