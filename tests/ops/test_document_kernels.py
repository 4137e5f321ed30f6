"""The Triton FlashAttention over packed documents (``cu_seqlens`` from the (B, T) ids) against the
block-causal SDPA mask (``model.documents.document_attention``): fp32, relative RMS <= 1e-5 on the
output and dQ, dK, dV; documents of lengths 5, 11, 16 | 32 | 1, 31, so a document is shorter than a
block, one has a single token, and block edges cut documents."""
from __future__ import annotations

import pytest
import torch

from tests.ops.kernel_utils import DEVICE, grads

pytest.importorskip("triton")

from ndtrain.model.documents import document_attention
from ndtrain.ops.flash_attention.naive import cu_seqlens_of
from ndtrain.ops.flash_attention.triton import flash_attention_bhtd
from tests.utils import rel_err


def _documents() -> torch.Tensor:
    lengths = ([5, 11, 16], [32], [1, 31])
    return torch.stack([torch.repeat_interleave(torch.arange(len(ls)), torch.tensor(ls)) for ls in lengths]).to(DEVICE)


def test_cu_seqlens_from_documents():
    assert cu_seqlens_of(_documents()).tolist() == [0, 5, 16, 32, 64, 65, 96]


def test_flash_packed_documents_match_block_causal_sdpa():
    docs = _documents()
    torch.manual_seed(3)
    qkv = [torch.randn(3, h, 32, 16, device=DEVICE, requires_grad=True) for h in (2, 1, 1)]
    y, g, dy = grads(lambda q, k, v: flash_attention_bhtd(q, k, v, (16, 16), documents=docs), qkv)
    y_ref, g_ref, _ = grads(lambda q, k, v: document_attention(q, k, v, docs), qkv, dy)
    errs = [rel_err(y, y_ref, "rms")] + [rel_err(a, b, "rms") for a, b in zip(g, g_ref)]
    assert max(errs) <= 1e-5, errs
    y_plain = flash_attention_bhtd(*(t.detach() for t in qkv), (16, 16))  # one document per row
    assert rel_err(y_plain, y_ref) > 1e-2
