"""Triton GeLU, SwiGLU, softmax, RMSNorm and tiled matmul against their PyTorch twins.

Reference: each op's ``naive.py`` (and PyTorch's own ops where they exist). Tolerance: relative RMS
<= 1e-5 in fp32 on outputs and every gradient (the issue's bound; fp32 reassociation alone gives
~1e-7 here). On CPU the kernels run in Triton's interpreter, so shapes are small and odd (masks
are exercised); the ``gpu`` tests repeat them at real sizes in bf16 (tolerance 1e-2: bf16 has a
7-bit mantissa, ~4e-3 relative rounding per element).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.ops.kernel_utils import DEVICE, grads

pytest.importorskip("triton")

from ndtrain.ops.gelu.naive import naive_gelu
from ndtrain.ops.gelu.triton import fused_gelu
from ndtrain.ops.matmul.naive import naive_matmul
from ndtrain.ops.matmul.triton import fused_matmul
from ndtrain.ops.rmsnorm.naive import naive_rmsnorm
from ndtrain.ops.rmsnorm.triton import fused_rmsnorm
from ndtrain.ops.softmax.naive import naive_softmax
from ndtrain.ops.softmax.triton import fused_softmax
from ndtrain.ops.swiglu.naive import naive_swiglu
from ndtrain.ops.swiglu.triton import fused_swiglu
from tests.utils import rel_err


def _pin(fast, slow, shapes, tol=1e-5, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    xs = [torch.randn(s, device=DEVICE, dtype=dtype, requires_grad=True) for s in shapes]
    y, g, dy = grads(fast, xs)
    y_ref, g_ref, _ = grads(slow, xs, dy)
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
    errs = [rel_err(y, y_ref, "rms")] + [rel_err(a, b, "rms") for a, b in zip(g, g_ref)]
    assert max(errs) <= tol, errs
    return errs


def test_naive_twins_match_pytorch():
    """The twins themselves are the textbook formulas: pin them to PyTorch's ops."""
    x, w = torch.randn(4, 24), torch.randn(24)
    assert rel_err(naive_gelu(x), F.gelu(x, approximate="tanh"), "rms") < 1e-6
    assert rel_err(naive_softmax(x), x.softmax(-1), "rms") < 1e-6
    assert rel_err(naive_rmsnorm(x, w, 1e-5), F.rms_norm(x, (24,), w, 1e-5), "rms") < 1e-6


def test_gelu_and_swiglu():
    _pin(fused_gelu, naive_gelu, [(7, 33)])
    _pin(fused_swiglu, naive_swiglu, [(3, 5, 41), (3, 5, 41)])


@pytest.mark.parametrize("block", [0, 16])  # one row per program; blocked reduction (3 blocks / row)
def test_softmax_schedules(block):
    _pin(lambda x: fused_softmax(x, block=block), naive_softmax, [(2, 5, 37)])
    big = torch.tensor([[1000.0, 0.0, -1000.0]])  # online max keeps exp in range
    assert torch.allclose(fused_softmax(big, block=block), torch.tensor([[1.0, 0.0, 0.0]]))


def test_rmsnorm_forward_backward():
    """Odd width (masked lanes), 3-D input, rows not a multiple of the backward's ROWS."""
    _pin(lambda x, w: fused_rmsnorm(x, w, 1e-5), lambda x, w: naive_rmsnorm(x, w, 1e-5), [(3, 19, 40), (40,)])


@pytest.mark.parametrize("activation", ["none", "gelu", "silu", "relu"])
def test_matmul_epilogue(activation):
    """M, N, K not multiples of the 32-tiles; grouped ordering with fewer tile-rows than GROUP_M
    (the last group is short), bias and each activation fused; transposed views in backward."""
    _pin(lambda a, b, c: fused_matmul(a, b, c, activation), lambda a, b, c: naive_matmul(a, b, c, activation),
         [(70, 50), (50, 45), (45,)])


def test_matmul_grouped_order_many_groups():
    """9 tile-rows x 2 tile-columns in groups of 4 tile-rows (the last group has 1): the remapped
    program ids must cover every output tile (a missed tile keeps ``torch.empty``'s garbage)."""
    _pin(lambda a, b: fused_matmul(a, b, block=(16, 16, 16), group_m=4), lambda a, b: a @ b,
         [(130, 16), (16, 20)])


def test_matmul_no_bias_and_errors():
    _pin(lambda a, b: fused_matmul(a, b), lambda a, b: a @ b, [(33, 17), (17, 40)])
    with pytest.raises(ValueError, match="do not chain"):
        fused_matmul(torch.randn(3, 4), torch.randn(5, 6))
    with pytest.raises(ValueError, match="activation"):
        fused_matmul(torch.randn(3, 4), torch.randn(4, 6), activation="tanh")


def test_bf16_small():
    """bf16 inputs (fp32 math inside, rounding at the store): 1e-2 relative RMS (bf16's 8-bit
    mantissa rounds each element by up to 2^-9; the eager twins round intermediates too)."""
    _pin(lambda x, w: fused_rmsnorm(x, w, 1e-5), lambda x, w: naive_rmsnorm(x, w, 1e-5), [(4, 8, 64), (64,)],
         1e-2, torch.bfloat16)
    _pin(fused_swiglu, naive_swiglu, [(4, 32), (4, 32)], 1e-2, torch.bfloat16)
    _pin(fused_gelu, naive_gelu, [(4, 32)], 1e-2, torch.bfloat16)
    _pin(lambda a, b: fused_matmul(a, b, activation="silu"), lambda a, b: naive_matmul(a, b, activation="silu"),
         [(33, 40), (40, 20)], 1e-2, torch.bfloat16)


@pytest.mark.gpu
def test_elementwise_gpu_bf16_big():
    if DEVICE != "cuda":
        pytest.skip("needs CUDA")
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        _pin(fused_gelu, naive_gelu, [(4096, 4096)], tol, dtype)
        _pin(fused_swiglu, naive_swiglu, [(4096, 8192), (4096, 8192)], tol, dtype)
        _pin(fused_softmax, naive_softmax, [(1024, 32768)], tol, dtype)
        _pin(lambda x, w: fused_rmsnorm(x, w, 1e-5), lambda x, w: naive_rmsnorm(x, w, 1e-5),
             [(8192, 4096), (4096,)], tol, dtype)
        _pin(lambda a, b, c: fused_matmul(a, b, c, "gelu", (128, 128, 32)),
             lambda a, b, c, dt=dtype: naive_matmul(a.float(), b.float(), c.float(), "gelu").to(dt),
             [(2048, 1024), (1024, 3072), (3072,)], tol, dtype)
