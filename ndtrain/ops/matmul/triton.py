"""Triton tiled matmul with grouped tile ordering and a fused epilogue (bias + activation).

Each program computes one (BLOCK_M, BLOCK_N) tile of ``C = act(A @ B + bias)`` with an fp32
accumulator; ``GROUP_M`` consecutive tile-rows share B's columns (the Triton tutorial's grouped
ordering: concurrent tiles hit L2). The epilogue runs in registers, so the pre-activation never
goes to memory. Backward: ``dz = dC * act'(z)`` (z kept when an activation is fused), ``dA = dz B^T``
and ``dB = A^T dz`` on the same kernel, ``dbias = sum_rows dz``. Twin: ``naive.naive_matmul``."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ndtrain.ops.matmul.naive import ACTIVATIONS

_ACT_CODE = {name: i for i, name in enumerate(ACTIVATIONS)}


@triton.jit
def _matmul_fwd_kernel(a_ptr, b_ptr, bias_ptr, c_ptr, z_ptr, M, N, K,
                       s_am, s_ak, s_bk, s_bn, s_cm, s_cn,
                       HAS_BIAS: tl.constexpr, ACT: tl.constexpr, SAVE_Z: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    n_m, n_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * n_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(a_ptr + rm[:, None] * s_am + kk[None, :] * s_ak,
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(b_ptr + kk[:, None] * s_bk + rn[None, :] * s_bn,
                    mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc += tl.dot(a, b, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SAVE_Z:
        tl.store(z_ptr + rm[:, None] * s_cm + rn[None, :] * s_cn, acc.to(z_ptr.dtype.element_ty), mask=mask)
    if ACT == 1:  # tanh-GeLU
        u = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
        acc = 0.5 * acc * (1.0 + (2.0 * tl.sigmoid(2.0 * u) - 1.0))
    elif ACT == 2:
        acc = acc * tl.sigmoid(acc)
    elif ACT == 3:
        acc = tl.maximum(acc, 0.0)
    tl.store(c_ptr + rm[:, None] * s_cm + rn[None, :] * s_cn, acc.to(c_ptr.dtype.element_ty), mask=mask)


def matmul_launch(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, activation: str = "none",
                  save_z: bool = False, block: tuple[int, int, int] = (32, 32, 32), group_m: int = 8):
    """a (M, K) @ b (K, N) (+ bias (N,), activation) -> (c (M, N), z (M, N) or None); any strides.
    ``block`` (BLOCK_M, BLOCK_N, BLOCK_K): powers of two >= 16 (tl.dot's minimum)."""
    (m, k), n = a.shape, b.shape[1]
    c = torch.empty(m, n, dtype=a.dtype, device=a.device)
    z = torch.empty_like(c) if save_z else c
    bm, bn, bk = block
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _matmul_fwd_kernel[grid](a, b, bias if bias is not None else c, c, z, m, n, k,
                             a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
                             HAS_BIAS=bias is not None, ACT=_ACT_CODE[activation], SAVE_Z=save_z,
                             BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m)
    return c, (z if save_z else None)


def _act_grad(z: torch.Tensor, activation: str) -> torch.Tensor:
    """d act / dz at z, via autograd of the reference activation (the epilogue's derivative)."""
    with torch.enable_grad():
        zz = z.detach().requires_grad_(True)
        y = F.gelu(zz, approximate="tanh") if activation == "gelu" else F.silu(zz) if activation == "silu" \
            else torch.relu(zz)
        (g,) = torch.autograd.grad(y.sum(), zz)
    return g


class MatmulFunction(torch.autograd.Function):
    """Autograd wrapper: saves a, b and (with an activation) the pre-activation z."""

    @staticmethod
    def forward(ctx, a, b, bias, activation: str, block, group_m: int):
        c, z = matmul_launch(a, b, bias, activation, save_z=activation != "none", block=block, group_m=group_m)
        ctx.save_for_backward(a, b, z)
        ctx.activation, ctx.block, ctx.group_m, ctx.has_bias = activation, block, group_m, bias is not None
        return c

    @staticmethod
    def backward(ctx, dc):
        a, b, z = ctx.saved_tensors
        dz = dc if ctx.activation == "none" else dc * _act_grad(z, ctx.activation)
        da = matmul_launch(dz, b.t(), block=ctx.block, group_m=ctx.group_m)[0] if ctx.needs_input_grad[0] else None
        db = matmul_launch(a.t(), dz, block=ctx.block, group_m=ctx.group_m)[0] if ctx.needs_input_grad[1] else None
        dbias = dz.sum(0) if ctx.has_bias else None
        return da, db, dbias, None, None, None


def fused_matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, activation: str = "none",
                 block: tuple[int, int, int] = (32, 32, 32), group_m: int = 8) -> torch.Tensor:
    """``act(a @ b + bias)``: a (M, K), b (K, N), bias (N,) | None -> (M, N) in a's dtype, fp32
    accumulation. Raises ValueError for mismatched shapes or an activation outside ``ACTIVATIONS``."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} must be one of {ACTIVATIONS}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul shapes {tuple(a.shape)} @ {tuple(b.shape)} do not chain")
    if os.environ.get("TRITON_INTERPRET", "0") == "1" and a.dtype != torch.float32:
        # Triton 3.9's CPU interpreter computes 16-bit tl.dot wrongly: run it in fp32 there
        return fused_matmul(a.float(), b.float(), None if bias is None else bias.float(), activation, block,
                            group_m).to(a.dtype)
    return MatmulFunction.apply(a, b, bias, activation, block, group_m)
