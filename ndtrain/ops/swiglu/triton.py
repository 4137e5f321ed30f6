"""Triton fused SwiGLU gate ``silu(a) * b`` (Shazeer 2020): one pass forward, one for both gradients,
instead of eager's three kernels and two saved intermediates. Twin: ``naive.naive_swiglu``."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _swiglu_fwd_kernel(a_ptr, b_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (a * tl.sigmoid(a) * b).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(a_ptr, b_ptr, dy_ptr, da_ptr, db_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(a)
    tl.store(da_ptr + offs, (dy * b * s * (1.0 + a * (1.0 - s))).to(da_ptr.dtype.element_ty), mask=mask)
    tl.store(db_ptr + offs, (dy * a * s).to(db_ptr.dtype.element_ty), mask=mask)


class SwiGLUFunction(torch.autograd.Function):
    """Autograd wrapper: saves a and b; the backward kernel recomputes sigmoid(a)."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a, b = a.contiguous(), b.contiguous()
        y = torch.empty_like(a)
        n = a.numel()
        _swiglu_fwd_kernel[(triton.cdiv(n, BLOCK),)](a, b, y, n, BLOCK=BLOCK)
        ctx.save_for_backward(a, b)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        a, b = ctx.saved_tensors
        dy = dy.contiguous()
        da, db = torch.empty_like(a), torch.empty_like(b)
        n = a.numel()
        _swiglu_bwd_kernel[(triton.cdiv(n, BLOCK),)](a, b, dy, da, db, n, BLOCK=BLOCK)
        return da, db


def fused_swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a, b (..., F), same shape and dtype -> (..., F), fp32 math. Raises ValueError when shapes or dtypes
    differ."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"swiglu needs equal shapes and dtypes, got {tuple(a.shape)} {a.dtype} and "
                         f"{tuple(b.shape)} {b.dtype}")
    return SwiGLUFunction.apply(a, b)
