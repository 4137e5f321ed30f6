"""Three MoE ops written as autograd functions that keep less for backward than autograd's default.

* ``router_logits``: the router runs in float32 on bf16 weights (ZeRO >= 1); as plain casts the
  GEMM saves the float32 copy of its input (4 bytes per hidden unit and token) and of the router
  matrix (per microbatch). Here x and w are saved as given and cast again in backward.
* ``weighted_sum``: the routed outputs weighted by the float32 scores; as plain casts the product
  saves the float32 copy of the (N, k, C) outputs, twice the bf16 tensor. Here y is saved.
* ``scatter_rows``: rows put at given positions of a zero tensor (the combine's un-permute).
  ``index_copy``'s derivative keeps its source (its gradient formula names it, for the shape):
  one more (rows, C) tensor per routed copy. Here only the index is kept.

Forward and gradients are bitwise those of the plain expressions (``*_reference``, the slow twins
the tests compare against). With float32 / float64 tensors the casts are no-ops: only
``scatter_rows`` then saves less."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def router_logits_reference(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (N, C), w (E, C) -> x w^T (N, E) in ``dtype``, through autograd's own casts."""
    return F.linear(x.to(dtype), w.to(dtype))


def weighted_sum_reference(y: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """y (N, k, C), w (N, k) -> sum_j w[:, j] y[:, j] (N, C), computed in the promoted dtype of y and w,
    returned in ``out_dtype``, through autograd's own casts."""
    dt = torch.promote_types(y.dtype, w.dtype)
    return (y.to(dt) * w.unsqueeze(-1)).sum(1).to(out_dtype)


class UpcastLinear(torch.autograd.Function):
    """``router_logits_reference`` saving x and w in their own dtypes. x (N, C), w (E, C) -> (N, E).
    Autocast is off in both passes (the router is not autocast)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.dtype = dtype
        ctx.save_for_backward(x, w)
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.to(dtype), w.to(dtype))

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, w = ctx.saved_tensors
        gx = gw = None
        with torch.autocast(g.device.type, enabled=False):
            if ctx.needs_input_grad[0]:  # as mm's backward: g @ w, cast back by the copy's backward
                gx = g.mm(w.to(ctx.dtype)).to(x.dtype)
            if ctx.needs_input_grad[1]:  # g^T x, as linear's backward computes it (bitwise, tested)
                gw = g.t().mm(x.to(ctx.dtype)).to(w.dtype)
        return gx, gw, None


class WeightedSum(torch.autograd.Function):
    """``weighted_sum_reference`` saving y in its own dtype: y (N, k, C), w (N, k) -> (N, C)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        ctx.dtype = torch.promote_types(y.dtype, w.dtype)
        ctx.save_for_backward(y, w)
        return (y.to(ctx.dtype) * w.unsqueeze(-1)).sum(1).to(out_dtype)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        y, w = ctx.saved_tensors
        g = g.to(ctx.dtype).unsqueeze(1)  # (N, 1, C): the sum's gradient, broadcast over the k copies
        gy = (g * w.unsqueeze(-1)).to(y.dtype) if ctx.needs_input_grad[0] else None
        gw = (g * y.to(ctx.dtype)).sum(-1) if ctx.needs_input_grad[1] else None  # (N, k)
        return gy, gw, None


def scatter_rows_reference(src: torch.Tensor, index: torch.Tensor, n_rows: int) -> torch.Tensor:
    """src (M, C), index (M,) int64 distinct rows -> (n_rows, C): row index[i] = src[i], others 0."""
    return src.new_zeros(n_rows, src.shape[1]).index_copy(0, index, src)


class ScatterRows(torch.autograd.Function):
    """``scatter_rows_reference`` keeping only the index; backward gathers the rows back."""

    @staticmethod
    def forward(ctx, src: torch.Tensor, index: torch.Tensor, n_rows: int) -> torch.Tensor:
        ctx.save_for_backward(index)
        return src.new_zeros(n_rows, src.shape[1]).index_copy(0, index, src)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (index,) = ctx.saved_tensors
        return g.index_select(0, index), None, None


def scatter_rows(src: torch.Tensor, index: torch.Tensor, n_rows: int) -> torch.Tensor:
    """src (M, C), index (M,) distinct rows -> (n_rows, C), unlisted rows 0; backward keeps the index."""
    return ScatterRows.apply(src, index, n_rows)


def router_logits(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (N, C), w (E, C) -> logits (N, E) in ``dtype``; backward keeps x and w, not their casts."""
    return UpcastLinear.apply(x, w, dtype)


def weighted_sum(y: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """y (N, k, C), w (N, k) -> (N, C) in ``out_dtype``; backward keeps y, not its upcast copy."""
    return WeightedSum.apply(y, w, out_dtype)
