"""Triton RMSNorm forward and backward (Zhang & Sennrich 2019), one row per program.

Forward: ``r = rsqrt(mean(x^2) + eps)``, ``xhat = (x r)`` rounded to x's dtype, ``y = w xhat``; the
per-row ``r`` (fp32) is saved so the backward reads x once more instead of keeping xhat.
Backward, with ``g = dy w``, ``xn = x r``: ``dx = r (g - xn mean(g xn))`` and ``dw = sum_rows dy xhat``; each
program owns ``ROWS`` rows and writes one partial ``dw`` row, summed on the host (no atomics, so the
result is deterministic). Twin: ``ndtrain.ops.rmsnorm.naive.naive_rmsnorm``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS = 16  # rows per backward program: the partial-dw buffer is (R / ROWS, C)


@triton.jit
def _rmsnorm_fwd_kernel(x_ptr, w_ptr, y_ptr, r_ptr, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    xhat = (xf * r).to(x.dtype).to(tl.float32)  # the eager model rounds before the gain
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n_cols + cols, (w * xhat).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(r_ptr + row, r)


@triton.jit
def _rmsnorm_bwd_kernel(x_ptr, w_ptr, r_ptr, dy_ptr, dx_ptr, dw_ptr, n_rows, n_cols,
                        ROWS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ROWS):
        row = (pid * ROWS + i).to(tl.int64)
        if row < n_rows:
            x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
            r = tl.load(r_ptr + row)
            xn = x.to(tl.float32) * r
            dy = tl.load(dy_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            dw += dy * xn.to(x.dtype).to(tl.float32)  # the gain saw the rounded xhat
            g = dy * w  # the rounding is straight-through for dx, as in autograd of the eager form
            dx = r * (g - xn * (tl.sum(g * xn, axis=0) / n_cols))
            tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_ptr + pid * n_cols + cols, dw, mask=mask)


class RMSNormFunction(torch.autograd.Function):
    """Autograd wrapper: saves x, weight and the per-row rsqrt (R,) fp32."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        shape, c = x.shape, x.shape[-1]
        x2 = x.contiguous().view(-1, c)  # (R, C)
        out_dtype = torch.promote_types(x.dtype, weight.dtype)
        y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
        r = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        _rmsnorm_fwd_kernel[(x2.shape[0],)](x2, weight, y, r, c, eps, BLOCK=triton.next_power_of_2(c))
        ctx.save_for_backward(x2, weight, r)
        ctx.x_shape = shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, r = ctx.saved_tensors
        n_rows, c = x2.shape
        dy2 = dy.contiguous().view(n_rows, c)
        dx = torch.empty_like(x2)
        n_prog = triton.cdiv(n_rows, ROWS)
        dw = torch.empty(n_prog, c, dtype=torch.float32, device=x2.device)
        _rmsnorm_bwd_kernel[(n_prog,)](x2, weight, r, dy2, dx, dw, n_rows, c,
                                       ROWS=ROWS, BLOCK=triton.next_power_of_2(c))
        return dx.view(ctx.x_shape), dw.sum(0).to(weight.dtype), None


def fused_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., C), weight (C,) -> (..., C) in promote(x, weight), ``naive_rmsnorm``'s arithmetic. Raises
    ValueError when weight is not (C,)."""
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"rmsnorm weight {tuple(weight.shape)} does not match x's last dim {x.shape[-1]}")
    return RMSNormFunction.apply(x, weight, eps)
