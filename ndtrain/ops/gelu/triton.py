"""Triton tanh-GeLU, one program per block, forward and backward kernels: one read and one write per
element instead of the naive formula's intermediates. Twin: ``naive.naive_gelu``."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ndtrain.ops.gelu.naive import CUBIC, SQRT_2_OVER_PI

BLOCK = 1024


@triton.jit
def _tanh(u):
    return 2.0 * tl.sigmoid(2.0 * u) - 1.0  # tanh via sigmoid: portable across Triton versions


@triton.jit
def _gelu_fwd_kernel(x_ptr, y_ptr, n, K0: tl.constexpr, K1: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    t = _tanh(K0 * (x + K1 * x * x * x))
    tl.store(y_ptr + offs, (0.5 * x * (1.0 + t)).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_bwd_kernel(x_ptr, dy_ptr, dx_ptr, n, K0: tl.constexpr, K1: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    t = _tanh(K0 * (x + K1 * x * x * x))
    dt = (1.0 - t * t) * K0 * (1.0 + 3.0 * K1 * x * x)  # d tanh(u) / dx
    dx = dy * (0.5 * (1.0 + t) + 0.5 * x * dt)
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def gelu_forward(x: torch.Tensor) -> torch.Tensor:
    """Launch the forward kernel on a contiguous copy of x; returns y with x's shape and dtype."""
    x = x.contiguous()
    y = torch.empty_like(x)
    n = x.numel()
    _gelu_fwd_kernel[(triton.cdiv(n, BLOCK),)](x, y, n, K0=SQRT_2_OVER_PI, K1=CUBIC, BLOCK=BLOCK)
    return y


class GeluFunction(torch.autograd.Function):
    """Autograd wrapper: saves x (not y) and recomputes tanh in the backward kernel."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return gelu_forward(x)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (x,) = ctx.saved_tensors
        x, dy = x.contiguous(), dy.contiguous()
        dx = torch.empty_like(x)
        n = x.numel()
        _gelu_bwd_kernel[(triton.cdiv(n, BLOCK),)](x, dy, dx, n, K0=SQRT_2_OVER_PI, K1=CUBIC, BLOCK=BLOCK)
        return dx


def fused_gelu(x: torch.Tensor) -> torch.Tensor:
    """tanh-GeLU through the Triton kernels. x (...) any float dtype -> (...), same dtype; math in fp32."""
    return GeluFunction.apply(x)
