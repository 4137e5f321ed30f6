"""Fused linear + cross-entropy (chunked; Wijmans et al. 2024) against full-logits PyTorch CE.

Reference: ``naive_linear_cross_entropy`` = ``F.cross_entropy(h @ W^T)``. Tolerance: relative RMS
<= 1e-5 in fp32 on the per-token losses, dh and dW. Chunks of 16 tokens x 64 vocab rows over 37
tokens x 300 rows: partial last chunks on both axes, and one ignored label.
"""
from __future__ import annotations

import pytest
import torch

from tests.ops.kernel_utils import DEVICE, grads

pytest.importorskip("triton")

from ndtrain.ops.linear_cross_entropy.naive import naive_linear_cross_entropy
from ndtrain.ops.linear_cross_entropy.triton import _chunk_stats, fused_linear_cross_entropy
from tests.utils import rel_err


def _data(n=37, c=32, v=300, seed=0):
    torch.manual_seed(seed)
    h = torch.randn(n, c, device=DEVICE, requires_grad=True)
    w = torch.randn(v, c, device=DEVICE, requires_grad=True)
    labels = torch.randint(0, v, (n,), device=DEVICE)
    labels[3] = -100
    return h, w, labels


def test_matches_full_logits():
    h, w, labels = _data()
    y, g, dy = grads(lambda h, w: fused_linear_cross_entropy(h, w, labels, chunk_tokens=16, chunk_vocab=64), [h, w])
    y_ref, g_ref, _ = grads(lambda h, w: naive_linear_cross_entropy(h, w, labels), [h, w], dy)
    assert y[3] == 0 and y_ref[3] == 0
    errs = [rel_err(y, y_ref, "rms")] + [rel_err(a, b, "rms") for a, b in zip(g, g_ref)]
    assert max(errs) <= 1e-5, errs


def test_bf16_weights():
    """bf16 h and W (16-bit matmuls, fp32 softmax statistics): 1e-2 relative RMS against the twin
    in bf16 (whose logits are rounded to bf16 before the fp32 cross-entropy, as are these blocks)."""
    h, w, labels = _data()
    hb, wb = (t.detach().bfloat16().requires_grad_(True) for t in (h, w))
    y, g, dy = grads(lambda h, w: fused_linear_cross_entropy(h, w, labels, chunk_tokens=16, chunk_vocab=64),
                     [hb, wb])
    y_ref, g_ref, _ = grads(lambda h, w: naive_linear_cross_entropy(h, w, labels), [hb, wb], dy)
    assert g[0].dtype == torch.bfloat16 and g[1].dtype == torch.bfloat16
    errs = [rel_err(y, y_ref, "rms")] + [rel_err(a, b, "rms") for a, b in zip(g, g_ref)]
    assert max(errs) <= 1e-2, errs


def test_label_of_a_later_block_never_reads_a_padded_lane():
    """Vocab blocks of 48 rows (the kernel pads each to 64 lanes): labels 48..63 of the *next*
    block share a padded lane's column index in the first one and must not be read there."""
    h, w, labels = _data(n=16, v=96)
    labels[:] = torch.arange(48, 64)
    y, g, dy = grads(lambda h, w: fused_linear_cross_entropy(h, w, labels, chunk_tokens=16, chunk_vocab=48), [h, w])
    y_ref, g_ref, _ = grads(lambda h, w: naive_linear_cross_entropy(h, w, labels), [h, w], dy)
    errs = [rel_err(y, y_ref, "rms")] + [rel_err(a, b, "rms") for a, b in zip(g, g_ref)]
    assert max(errs) <= 1e-5, errs


def test_vocab_parallel_shards_combine_to_the_whole():
    """Two vocab shards [0, 150) and [150, 300): the caller's all-reduce (here done by hand from
    both shards' partial statistics) gives every shard the full loss; the shards' dh summed (the
    tensor-parallel all-reduce) and their dW concatenated equal the unsharded gradients."""
    h, w, labels = _data()
    shards = [(0, w[:150].detach()), (150, w[150:].detach())]
    parts = [_chunk_stats(h.detach(), ws, labels, v0, 64) for v0, ws in shards]
    m = torch.maximum(parts[0][0], parts[1][0])
    s = sum(p[1] * torch.exp(p[0] - m) for p in parts)
    t = sum(p[2] for p in parts)
    y_ref, g_ref, dy = grads(lambda h, w: naive_linear_cross_entropy(h, w, labels), [h, w])
    dh, dws = 0.0, []
    for v0, ws in shards:
        hh, wl = h.detach().requires_grad_(True), ws.requires_grad_(True)
        y, (gh, gw), _ = grads(lambda a, b, v0=v0: fused_linear_cross_entropy(
            a, b, labels, vocab_start=v0, combine=lambda *_: (m, s, t), chunk_tokens=16, chunk_vocab=64),
            [hh, wl], dy)
        assert rel_err(y, y_ref, "rms") <= 1e-5
        dh, dws = dh + gh, dws + [gw]
    assert rel_err(dh, g_ref[0], "rms") <= 1e-5 and rel_err(torch.cat(dws), g_ref[1], "rms") <= 1e-5


@pytest.mark.gpu
def test_fused_ce_gpu_bf16_big():
    if DEVICE != "cuda":
        pytest.skip("needs CUDA")
    h, w, labels = _data(n=8192, c=2048, v=128256)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        hc, wc = h.detach().to(dtype).requires_grad_(True), w.detach().to(dtype).requires_grad_(True)
        y, g, dy = grads(lambda a, b: fused_linear_cross_entropy(a, b, labels), [hc, wc])
        y_ref, g_ref, _ = grads(lambda a, b: naive_linear_cross_entropy(a, b, labels), [hc, wc], dy)
        errs = [rel_err(y, y_ref, "rms")] + [rel_err(a, b, "rms") for a, b in zip(g, g_ref)]
        assert max(errs) <= tol, (dtype, errs)
