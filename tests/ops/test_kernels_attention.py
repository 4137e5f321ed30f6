"""Triton FlashAttention-2 (Dao 2023) against the materialised-scores twin.

Reference: ``naive_attention`` (per document, fp32 softmax) and, for the model layout, the model's
own ``causal_attention`` (PyTorch SDPA). Tolerance: relative RMS <= 1e-5 in fp32 on the output and
dQ, dK, dV (measured ~2e-7: only summation order differs). Shapes: three query blocks of 16, GQA
4:2, documents of lengths 5, 17, 10 and 1 packed together, so block edges cut documents, a document
is shorter than a block, and one has a single token.
"""
from __future__ import annotations

import pytest
import torch

from tests.ops.kernel_utils import DEVICE, grads

pytest.importorskip("triton")

from ndtrain.model.attention import causal_attention
from ndtrain.ops.flash_attention.naive import naive_attention
from ndtrain.ops.flash_attention.triton import flash_attention, flash_attention_bhtd
from tests.utils import rel_err


def _qkv(n, h, g, d, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return [torch.randn(n, x, d, device=DEVICE, dtype=dtype, requires_grad=True) for x in (h, g, g)]


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_gqa_matches_naive(causal):
    cu = torch.tensor([0, 5, 22, 32, 33], dtype=torch.int32, device=DEVICE)
    qkv = _qkv(33, 4, 2, 16)
    y, g, dy = grads(lambda q, k, v: flash_attention(q, k, v, cu, causal=causal, blocks=(16, 16)), qkv)
    y_ref, g_ref, _ = grads(lambda q, k, v: naive_attention(q, k, v, cu, causal=causal), qkv, dy)
    errs = [rel_err(y, y_ref, "rms")] + [rel_err(a, b, "rms") for a, b in zip(g, g_ref)]
    assert max(errs) <= 1e-5, errs


def test_documents_do_not_see_each_other():
    """Changing document 2's keys leaves documents 1 and 3 unchanged (boundaries are respected)."""
    cu = torch.tensor([0, 8, 20, 32], dtype=torch.int32, device=DEVICE)
    q, k, v = (t.detach() for t in _qkv(32, 2, 2, 16))
    y1 = flash_attention(q, k, v, cu, blocks=(16, 16))
    k2 = k.clone()
    k2[8:20] *= 2.0  # not a constant shift: softmax is invariant to adding one vector to every key
    y2 = flash_attention(q, k2, v, cu, blocks=(16, 16))
    assert torch.equal(y1[:8], y2[:8]) and torch.equal(y1[20:], y2[20:])
    assert not torch.allclose(y1[8:20], y2[8:20])


def test_model_layout_matches_sdpa():
    torch.manual_seed(1)
    qkv = [torch.randn(2, h, 32, 16, device=DEVICE, requires_grad=True) for h in (4, 2, 2)]
    y, g, dy = grads(lambda q, k, v: flash_attention_bhtd(q, k, v, (16, 16)), qkv)
    y_ref, g_ref, _ = grads(causal_attention, qkv, dy)
    errs = [rel_err(y, y_ref, "rms")] + [rel_err(a, b, "rms") for a, b in zip(g, g_ref)]
    assert max(errs) <= 1e-5, errs


def test_model_layout_bf16():
    """bf16 (what autocast feeds the core): 1e-2 relative RMS against SDPA in bf16."""
    torch.manual_seed(2)
    qkv = [torch.randn(2, h, 32, 16, device=DEVICE, dtype=torch.bfloat16, requires_grad=True) for h in (4, 2, 2)]
    y, g, dy = grads(lambda q, k, v: flash_attention_bhtd(q, k, v, (16, 16)), qkv)
    y_ref, g_ref, _ = grads(causal_attention, qkv, dy)
    assert y.dtype == torch.bfloat16
    errs = [rel_err(y, y_ref, "rms")] + [rel_err(a, b, "rms") for a, b in zip(g, g_ref)]
    assert max(errs) <= 1e-2, errs


def test_rejects_bad_shapes():
    q, k, v = (t.detach() for t in _qkv(8, 3, 2, 16))
    with pytest.raises(ValueError, match="multiple of kv heads"):
        flash_attention(q, k, v, torch.tensor([0, 8]))
    q, k, v = (t.detach() for t in _qkv(8, 2, 2, 24))
    with pytest.raises(ValueError, match="power of two"):
        flash_attention(q, k, v, torch.tensor([0, 8]))


@pytest.mark.gpu
def test_flash_attention_gpu_bf16_big():
    if DEVICE != "cuda":
        pytest.skip("needs CUDA")
    lens = [1024, 3000, 77, 4096]
    cu = torch.tensor([0] + lens, device=DEVICE).cumsum(0).to(torch.int32)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        qkv = _qkv(int(cu[-1]), 16, 4, 128, dtype)
        y, g, dy = grads(lambda q, k, v: flash_attention(q, k, v, cu), qkv)
        y_ref, g_ref, _ = grads(lambda q, k, v: naive_attention(q, k, v, cu), qkv, dy)
        errs = [rel_err(y, y_ref, "rms")] + [rel_err(a, b, "rms") for a, b in zip(g, g_ref)]
        assert max(errs) <= tol, (dtype, errs)
