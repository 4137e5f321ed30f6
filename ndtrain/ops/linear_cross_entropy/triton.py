"""Fused linear + cross-entropy that never materialises the (N, V) logits (Wijmans et al. 2024, "Cut
Your Losses in Large-Vocabulary Language Models"; Liger-Kernel, Hsu et al. 2024).

Each (chunk_tokens, chunk_vocab) block of logits is a matmul reduced by ``_ce_block_stats_kernel``
to per-row (max, sum exp(logit - max), target logit), folded into running statistics (online
softmax) and freed: one fp32 block of extra memory instead of (N, V). Backward recomputes each
block into ``(softmax - onehot) * dloss`` (``_ce_block_grad_kernel``), then ``dh += G W_blk``,
``dW_blk += G^T h``. Vocab-parallel: the caller's ``combine`` all-reduces the partial statistics
into the global lse (no logits cross ranks) and must all-reduce dh over tp. Twin:
``naive.naive_linear_cross_entropy``."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ndtrain.ops.linear_cross_entropy.common import Combine, check_shapes, trim_padded_rows


@triton.jit
def _ce_block_stats_kernel(z_ptr, lab_ptr, max_ptr, sum_ptr, tgt_ptr, n_rows, n_cols, v0,
                           ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    lab = tl.load(lab_ptr + rows, mask=row_ok, other=0) - v0  # the label's column in this block, if any
    base = rows.to(tl.int64)[:, None] * n_cols
    m = tl.full([ROWS], float("-inf"), tl.float32)
    s = tl.zeros([ROWS], dtype=tl.float32)
    t = tl.zeros([ROWS], dtype=tl.float32)
    for c0 in range(0, n_cols, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        mask = row_ok[:, None] & (cols < n_cols)[None, :]
        z = tl.load(z_ptr + base + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # an all-masked row keeps s = 0, not NaN
        s = s * tl.exp(m - m_ref) + tl.sum(tl.exp(z - m_ref[:, None]), axis=1)
        # the mask matters: a label of the next block can equal a padded lane's column
        t += tl.sum(tl.where(mask & (cols[None, :] == lab[:, None]), z, 0.0), axis=1)
        m = m_new
    tl.store(max_ptr + rows, m, mask=row_ok)
    tl.store(sum_ptr + rows, s, mask=row_ok)
    tl.store(tgt_ptr + rows, t, mask=row_ok)


@triton.jit
def _ce_block_grad_kernel(z_ptr, lab_ptr, lse_ptr, g_ptr, n_rows, n_cols, v0,
                          ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    lab = tl.load(lab_ptr + rows, mask=row_ok, other=0) - v0
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    g = tl.load(g_ptr + rows, mask=row_ok, other=0.0)
    base = rows.to(tl.int64)[:, None] * n_cols
    for c0 in range(0, n_cols, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        mask = row_ok[:, None] & (cols < n_cols)[None, :]
        z = tl.load(z_ptr + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        onehot = tl.where(cols[None, :] == lab[:, None], 1.0, 0.0)
        tl.store(z_ptr + base + cols[None, :], (tl.exp(z - lse[:, None]) - onehot) * g[:, None], mask=mask)


def _launch_shape(n_rows: int, n_cols: int) -> tuple[tuple[int], dict]:
    """Grid and (ROWS, BLOCK): a few rows and 2048-column sweeps on a GPU; many rows, whole block in the
    interpreter."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        rows, block = 64, triton.next_power_of_2(n_cols)
    else:
        rows, block = 4, min(2048, triton.next_power_of_2(n_cols))
    return (triton.cdiv(n_rows, rows),), {"ROWS": rows, "BLOCK": block}


def _block_logits(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (h @ w.t()).float().contiguous()  # (Tc, Vc) fp32


def _chunk_stats(h, w, labels, vocab_start, chunk_vocab):
    """Per-token (max, sumexp, target logit) of h's logits over this rank's rows of w."""
    n = h.shape[0]
    m = torch.full((n,), float("-inf"), device=h.device)
    s = torch.zeros(n, device=h.device)
    tgt = torch.zeros(n, device=h.device)
    bm, bs, bt = torch.empty_like(m), torch.empty_like(m), torch.empty_like(m)
    for v0 in range(0, w.shape[0], chunk_vocab):
        z = _block_logits(h, w[v0:v0 + chunk_vocab])
        grid, meta = _launch_shape(n, z.shape[1])
        _ce_block_stats_kernel[grid](z, labels, bm, bs, bt, n, z.shape[1], vocab_start + v0, **meta)
        m_new = torch.maximum(m, bm)
        s = s * torch.exp(m - m_new) + bs * torch.exp(bm - m_new)
        m, tgt = m_new, tgt + bt
    return m, s, tgt


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Autograd wrapper; saves h, w, labels and the per-token lse (N,) fp32."""

    @staticmethod
    def forward(ctx, h, w, labels, ignore_index: int, vocab_start: int, combine: Combine | None,
                chunk_tokens: int, chunk_vocab: int):
        stats = [_chunk_stats(h[t0:t0 + chunk_tokens], w, labels[t0:t0 + chunk_tokens], vocab_start, chunk_vocab)
                 for t0 in range(0, h.shape[0], chunk_tokens)]
        m, s, tgt = (torch.cat(x) for x in zip(*stats))  # (N,) each
        if combine is not None:
            m, s, tgt = combine(m, s, tgt)
        lse = m + torch.log(s)
        valid = labels != ignore_index
        loss = torch.where(valid, lse - tgt, 0.0)
        ctx.save_for_backward(h, w, labels, lse)
        ctx.meta = (ignore_index, vocab_start, chunk_tokens, chunk_vocab)
        return loss

    @staticmethod
    def backward(ctx, dloss):
        h, w, labels, lse = ctx.saved_tensors
        ignore_index, vocab_start, chunk_tokens, chunk_vocab = ctx.meta
        g = torch.where(labels != ignore_index, dloss.float(), 0.0).contiguous()  # (N,)
        dh = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
        dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        for t0 in range(0, h.shape[0], chunk_tokens):
            hc, sl = h[t0:t0 + chunk_tokens], slice(t0, t0 + chunk_tokens)
            for v0 in range(0, w.shape[0], chunk_vocab):
                wb = w[v0:v0 + chunk_vocab]
                z = _block_logits(hc, wb)  # becomes the block's dlogits in place
                grid, meta = _launch_shape(*z.shape)
                _ce_block_grad_kernel[grid](z, labels[sl], lse[sl], g[sl], *z.shape, vocab_start + v0, **meta)
                zc = z.to(wb.dtype)  # 16-bit weights: 16-bit matmul operands, fp32 accumulation below
                dh[sl] += (zc @ wb).float()
                dw[v0:v0 + chunk_vocab] += (zc.t() @ hc.to(wb.dtype)).float()
        return dh.to(h.dtype), dw.to(w.dtype), None, None, None, None, None, None


def fused_linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               ignore_index: int = -100, vocab_start: int = 0, combine: Combine | None = None,
                               chunk_tokens: int = 1024, chunk_vocab: int = 8192,
                               vocab_size: int | None = None) -> torch.Tensor:
    """Per-token cross-entropy of ``h @ weight^T``: h (N, C), weight (V_local, C) (rows from
    ``vocab_start``), labels (N,) global ids -> (N,) fp32, 0 at ``ignore_index``. ``combine``: None, or
    the vocab-parallel all-reduce returning the global (max, sumexp, target). ``vocab_size``: the real V
    of a padded W (padded rows get no probability, zero gradient). Raises ValueError for mismatched shapes.
    """
    check_shapes(h, weight, labels)
    weight = trim_padded_rows(weight, vocab_start, vocab_size)
    return LinearCrossEntropyFunction.apply(h, weight, labels.contiguous(), ignore_index, vocab_start, combine,
                                            chunk_tokens, chunk_vocab)
