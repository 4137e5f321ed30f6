"""Triton row softmax, two schedules: one row per program in registers (one read and write; N <=
``MAX_ROW_BLOCK``), or for long rows a pass keeping the running max and rescaled sum (online
softmax, Milakov & Gimelshein 2018) then a writing pass. Backward ``dx = y * (dy - sum(y * dy))``.
Twin: ``naive.naive_softmax``."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROW_BLOCK = 4096


@triton.jit
def _softmax_row_fwd_kernel(x_ptr, y_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=-float("inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(y_ptr + row * n_cols + cols, (e / tl.sum(e, axis=0)).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_blocked_fwd_kernel(x_ptr, y_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * n_cols
    m = -float("inf")
    s = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + base + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + base + cols, mask=mask, other=-float("inf")).to(tl.float32)
        tl.store(y_ptr + base + cols, (tl.exp(x - m) / s).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_bwd_kernel(y_ptr, dy_ptr, dx_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * n_cols
    dot = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        y = tl.load(y_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        dot += tl.sum(y * dy, axis=0)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        y = tl.load(y_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + base + cols, (y * (dy - dot)).to(dx_ptr.dtype.element_ty), mask=mask)


class SoftmaxFunction(torch.autograd.Function):
    """Autograd wrapper over the forward schedules; saves the output y for the backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, block: int) -> torch.Tensor:
        shape = x.shape
        x2 = x.contiguous().view(-1, shape[-1])  # (R, N) rows
        y = torch.empty_like(x2)
        n = x2.shape[1]
        if block == 0:
            _softmax_row_fwd_kernel[(x2.shape[0],)](x2, y, n, BLOCK=triton.next_power_of_2(n))
        else:
            _softmax_blocked_fwd_kernel[(x2.shape[0],)](x2, y, n, BLOCK=block)
        ctx.save_for_backward(y)
        ctx.block = block or triton.next_power_of_2(n)
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (y,) = ctx.saved_tensors
        dy2 = dy.contiguous().view(y.shape)
        dx = torch.empty_like(y)
        _softmax_bwd_kernel[(y.shape[0],)](y, dy2, dx, y.shape[1], BLOCK=min(ctx.block, MAX_ROW_BLOCK))
        return dx.view(dy.shape), None


def fused_softmax(x: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """Softmax over the last dim: x (..., N) -> (..., N), same dtype, fp32 math. ``block``: None picks the
    schedule, 0 forces one row per program, a power of two the blocked one. Raises ValueError for a
    block that is not a power of two."""
    n = x.shape[-1]
    if block is None:
        block = 0 if triton.next_power_of_2(n) <= MAX_ROW_BLOCK else 1024
    if block and block & (block - 1):
        raise ValueError(f"softmax block ({block}) must be a power of two")
    return SoftmaxFunction.apply(x, block)
