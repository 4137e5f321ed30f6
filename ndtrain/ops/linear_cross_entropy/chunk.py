"""Chunked linear + cross-entropy in plain PyTorch: ``triton.py``'s algorithm (Wijmans et al. 2024)
on any device and dtype (float64 included): the fused loss of ``training.kernels=eager`` and the
Triton version's twin. Matmuls run in the autocast dtype when under autocast (kept for the
backward, which runs outside it), else h's; statistics and block gradients in
``promote(h.dtype, float32)``."""
from __future__ import annotations

import torch

from ndtrain.ops.linear_cross_entropy.common import Combine, check_shapes, trim_padded_rows


def _mm_dtype(h: torch.Tensor) -> torch.dtype:
    dev = h.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype


def _block_logits(h: torch.Tensor, w: torch.Tensor, mm: torch.dtype, acc: torch.dtype) -> torch.Tensor:
    return (h.to(mm) @ w.to(mm).t()).to(acc)  # (Tc, Vc)


def _target_in_block(z: torch.Tensor, labels: torch.Tensor, v0: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(in_block (Tc,) bool, column (Tc,) long clamped into the block) of each row's label."""
    col = labels - v0
    inside = (col >= 0) & (col < z.shape[1])
    return inside, col.clamp(0, z.shape[1] - 1)


def _chunk_stats(h, w, labels, vocab_start, chunk_vocab, mm, acc):
    """Per-token (max, sumexp, target logit), each (Tc,), of h's logits over this rank's rows of w."""
    n = h.shape[0]
    m = torch.full((n,), float("-inf"), dtype=acc, device=h.device)
    s = torch.zeros(n, dtype=acc, device=h.device)
    tgt = torch.zeros(n, dtype=acc, device=h.device)
    for v0 in range(0, w.shape[0], chunk_vocab):
        z = _block_logits(h, w[v0:v0 + chunk_vocab], mm, acc)  # (Tc, Vc)
        inside, col = _target_in_block(z, labels, vocab_start + v0)
        tgt = tgt + torch.where(inside, z.gather(1, col[:, None]).squeeze(1), 0.0)
        bm = z.amax(dim=1)
        m_new = torch.maximum(m, bm)
        s = s * torch.exp(m - m_new) + torch.exp(z - m_new[:, None]).sum(dim=1)
        m = m_new
    return m, s, tgt


class ChunkedLinearCrossEntropyFunction(torch.autograd.Function):
    """Autograd wrapper; saves h, w, labels and the per-token log-sum-exp (N,)."""

    @staticmethod
    def forward(ctx, h, w, labels, ignore_index: int, vocab_start: int, combine: Combine | None,
                chunk_tokens: int, chunk_vocab: int):
        mm, acc = _mm_dtype(h), torch.promote_types(h.dtype, torch.float32)
        with torch.autocast(h.device.type, enabled=False):
            stats = [_chunk_stats(h[t0:t0 + chunk_tokens], w, labels[t0:t0 + chunk_tokens], vocab_start,
                                  chunk_vocab, mm, acc) for t0 in range(0, h.shape[0], chunk_tokens)]
            m, s, tgt = (torch.cat(x) for x in zip(*stats))  # (N,) each
            if combine is not None:
                m, s, tgt = combine(m, s, tgt)
            lse = m + torch.log(s)
            loss = torch.where(labels != ignore_index, lse - tgt, 0.0)
        ctx.save_for_backward(h, w, labels, lse)
        ctx.meta = (ignore_index, vocab_start, chunk_tokens, chunk_vocab, mm)
        return loss

    @staticmethod
    def backward(ctx, dloss):
        h, w, labels, lse = ctx.saved_tensors
        ignore_index, vocab_start, chunk_tokens, chunk_vocab, mm = ctx.meta
        acc = lse.dtype
        g = torch.where(labels != ignore_index, dloss.to(acc), 0.0)  # (N,)
        dh = torch.zeros(h.shape, dtype=acc, device=h.device)
        dw = torch.zeros(w.shape, dtype=acc, device=w.device)
        for t0 in range(0, h.shape[0], chunk_tokens):
            sl = slice(t0, t0 + chunk_tokens)
            hc = h[sl].to(mm)
            for v0 in range(0, w.shape[0], chunk_vocab):
                wb = w[v0:v0 + chunk_vocab].to(mm)
                z = _block_logits(hc, wb, mm, acc)  # (Tc, Vc) -> its dlogits in place
                inside, col = _target_in_block(z, labels[sl], vocab_start + v0)
                z.sub_(lse[sl, None]).exp_()
                z.scatter_add_(1, col[:, None], -inside.to(acc)[:, None])  # softmax - onehot
                z.mul_(g[sl, None])
                zc = z.to(mm)
                dh[sl] += (zc @ wb).to(acc)
                dw[v0:v0 + chunk_vocab] += (zc.t() @ hc).to(acc)
        return dh.to(h.dtype), dw.to(w.dtype), None, None, None, None, None, None


def chunk_linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               ignore_index: int = -100, vocab_start: int = 0, combine: Combine | None = None,
                               chunk_tokens: int = 1024, chunk_vocab: int = 8192,
                               vocab_size: int | None = None) -> torch.Tensor:
    """``triton.fused_linear_cross_entropy``'s contract in PyTorch: (N,) losses in
    ``promote(h.dtype, fp32)``. Raises ValueError for mismatched shapes."""
    check_shapes(h, weight, labels)
    weight = trim_padded_rows(weight, vocab_start, vocab_size)
    return ChunkedLinearCrossEntropyFunction.apply(h, weight, labels.contiguous(), ignore_index, vocab_start,
                                                   combine, chunk_tokens, chunk_vocab)
