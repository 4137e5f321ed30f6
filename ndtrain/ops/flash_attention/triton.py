"""FlashAttention-2 forward and backward in Triton (Dao 2023), causal, GQA, packed documents.

Forward: one program per (query block, document, head) walks its document's key blocks with the
online softmax (running max m, sum l, unnormalised accumulator; one division by l at the end) and
writes only ``lse = m + log l`` (H, N), never (T, T) scores. Backward: ``delta = rowsum(dO * O)``;
``_flash_attn_bwd_dkdv_kernel`` walks query blocks per key block recomputing ``P = exp(S - lse)``
(``dV = P^T dO``, ``dK = scale dS^T Q``, ``dS = P (dP - delta)``); a separate dQ kernel avoids FA2's
atomics (one more recompute for determinism). GQA dK / dV are summed over the H / G heads on the
host. Twin: ``naive.naive_attention``."""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from ndtrain.ops.flash_attention.naive import cu_seqlens_of

NEG = -1.0e30  # a finite "minus infinity": fully masked rows stay NaN-free


@triton.jit
def _span(cu_ptr, pid_sh, H, GROUP):
    """(query head h, kv head g, first token, length) of this program's (document, head)."""
    seq, h = pid_sh // H, pid_sh % H
    start = tl.load(cu_ptr + seq)
    return h, h // GROUP, start, tl.load(cu_ptr + seq + 1) - start


@triton.jit
def _load_kv(k_ptr, v_ptr, start, rn, g, s_kt, s_kh, rd, col_ok):
    """K and V tiles (BLOCK_N, D) of kv head g, zero past the document's end."""
    at = (start + rn)[:, None] * s_kt + g * s_kh + rd[None, :]
    return (tl.load(k_ptr + at, mask=col_ok[:, None], other=0.0),
            tl.load(v_ptr + at, mask=col_ok[:, None], other=0.0))


@triton.jit
def _load_rows(q_ptr, do_ptr, lse_ptr, delta_ptr, start, rm, h, N, s_qt, s_qh, rd, row_ok):
    """The backward's per-query tiles of head h: Q, dO (BLOCK_M, D), lse, delta (BLOCK_M,)."""
    rows = (start + rm)[:, None] * s_qt + h * s_qh + rd[None, :]
    at = h * N + start + rm
    return (tl.load(q_ptr + rows, mask=row_ok[:, None], other=0.0),
            tl.load(do_ptr + rows, mask=row_ok[:, None], other=0.0),
            tl.load(lse_ptr + at, mask=row_ok, other=0.0), tl.load(delta_ptr + at, mask=row_ok, other=0.0))


@triton.jit
def _probs(q, k, lse, rm, rn, row_ok, col_ok, scale, CAUSAL: tl.constexpr):
    """The backward's recomputed P = exp(S - lse) (BLOCK_M, BLOCK_N), zero where masked."""
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    valid = row_ok[:, None] & col_ok[None, :]
    if CAUSAL:
        valid = valid & (rm[:, None] >= rn[None, :])
    return tl.where(valid, tl.exp(s - lse[:, None]), 0.0)


@triton.jit
def _flash_attn_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, cu_ptr, scale, N, H, GROUP,
                           s_qt, s_qh, s_kt, s_kh, s_ot, s_oh,
                           CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m, pid_sh = tl.program_id(0), tl.program_id(1)
    h, g, start, length = _span(cu_ptr, pid_sh, H, GROUP)
    if pid_m * BLOCK_M < length:
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rd = tl.arange(0, D)
        row_ok = rm < length
        q = tl.load(q_ptr + (start + rm)[:, None] * s_qt + h * s_qh + rd[None, :], mask=row_ok[:, None], other=0.0)
        m_i = tl.full([BLOCK_M], NEG, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        hi = tl.minimum(length, (pid_m + 1) * BLOCK_M) if CAUSAL else length
        for n0 in range(0, hi, BLOCK_N):
            rn = n0 + tl.arange(0, BLOCK_N)
            col_ok = rn < length
            k, v = _load_kv(k_ptr, v_ptr, start, rn, g, s_kt, s_kh, rd, col_ok)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # (BLOCK_M, BLOCK_N) fp32
            valid = col_ok[None, :]
            if CAUSAL:
                valid = valid & (rm[:, None] >= rn[None, :])
            s = tl.where(valid, s, NEG)
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.where(valid, tl.exp(s - m_new[:, None]), 0.0)
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            m_i = m_new
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        tl.store(o_ptr + (start + rm)[:, None] * s_ot + h * s_oh + rd[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None])
        tl.store(lse_ptr + h * N + start + rm, m_i + tl.log(l_safe), mask=row_ok)


@triton.jit
def _flash_attn_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, cu_ptr,
                                scale, N, H, GROUP, s_qt, s_qh, s_kt, s_kh, s_gt, s_gh,
                                CAUSAL: tl.constexpr, D: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_n, pid_sh = tl.program_id(0), tl.program_id(1)
    h, g, start, length = _span(cu_ptr, pid_sh, H, GROUP)
    if pid_n * BLOCK_N < length:
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rd = tl.arange(0, D)
        col_ok = rn < length
        k, v = _load_kv(k_ptr, v_ptr, start, rn, g, s_kt, s_kh, rd, col_ok)
        dk = tl.zeros([BLOCK_N, D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, D], dtype=tl.float32)
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M if CAUSAL else 0
        for m0 in range(lo, length, BLOCK_M):
            rm = m0 + tl.arange(0, BLOCK_M)
            row_ok = rm < length
            q, do, lse, delta = _load_rows(q_ptr, do_ptr, lse_ptr, delta_ptr, start, rm, h, N, s_qt, s_qh, rd, row_ok)
            p = _probs(q, k, lse, rm, rn, row_ok, col_ok, scale, CAUSAL)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision="ieee")
            dp = tl.dot(do, tl.trans(v), input_precision="ieee")
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision="ieee")
        out = (start + rn)[:, None] * s_gt + h * s_gh + rd[None, :]
        tl.store(dk_ptr + out, (dk * scale).to(dk_ptr.dtype.element_ty), mask=col_ok[:, None])
        tl.store(dv_ptr + out, dv.to(dv_ptr.dtype.element_ty), mask=col_ok[:, None])


@triton.jit
def _flash_attn_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, cu_ptr,
                              scale, N, H, GROUP, s_qt, s_qh, s_kt, s_kh,
                              CAUSAL: tl.constexpr, D: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m, pid_sh = tl.program_id(0), tl.program_id(1)
    h, g, start, length = _span(cu_ptr, pid_sh, H, GROUP)
    if pid_m * BLOCK_M < length:
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rd = tl.arange(0, D)
        row_ok = rm < length
        q, do, lse, delta = _load_rows(q_ptr, do_ptr, lse_ptr, delta_ptr, start, rm, h, N, s_qt, s_qh, rd, row_ok)
        rows = (start + rm)[:, None] * s_qt + h * s_qh + rd[None, :]
        dq = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        hi = tl.minimum(length, (pid_m + 1) * BLOCK_M) if CAUSAL else length
        for n0 in range(0, hi, BLOCK_N):
            rn = n0 + tl.arange(0, BLOCK_N)
            col_ok = rn < length
            k, v = _load_kv(k_ptr, v_ptr, start, rn, g, s_kt, s_kh, rd, col_ok)
            p = _probs(q, k, lse, rm, rn, row_ok, col_ok, scale, CAUSAL)
            dp = tl.dot(do, tl.trans(v), input_precision="ieee")
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k, input_precision="ieee")
        tl.store(dq_ptr + rows, (dq * scale).to(dq_ptr.dtype.element_ty), mask=row_ok[:, None])


def _grid(max_seqlen: int, block: int, n_seqs: int, h: int):
    return (triton.cdiv(max_seqlen, block), n_seqs * h)


class FlashAttentionFunction(torch.autograd.Function):
    """Autograd wrapper: saves q, k, v, o and lse (H, N) fp32; no (T, T) tensor in either pass."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen: int, causal: bool, scale: float, blocks):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        n, h, d = q.shape
        group = h // k.shape[1]
        bm, bn = blocks
        o = torch.empty_like(q)
        lse = torch.empty(h, n, dtype=torch.float32, device=q.device)
        n_seqs = cu_seqlens.numel() - 1
        _flash_attn_fwd_kernel[_grid(max_seqlen, bm, n_seqs, h)](
            q, k, v, o, lse, cu_seqlens, scale, n, h, group, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            o.stride(0), o.stride(1), CAUSAL=causal, D=d, BLOCK_M=bm, BLOCK_N=bn)
        ctx.save_for_backward(q, k, v, o, lse, cu_seqlens)
        ctx.meta = (max_seqlen, causal, scale, blocks)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, cu = ctx.saved_tensors
        max_seqlen, causal, scale, (bm, bn) = ctx.meta
        do = do.contiguous()
        n, h, d = q.shape
        g = k.shape[1]
        delta = (do.float() * o.float()).sum(-1).t().contiguous()  # (H, N)
        dk_h = torch.empty(n, h, d, dtype=q.dtype, device=q.device)  # per query head, summed below
        dv_h = torch.empty_like(dk_h)
        dq = torch.empty_like(q)
        n_seqs = cu.numel() - 1
        _flash_attn_bwd_dkdv_kernel[_grid(max_seqlen, bn, n_seqs, h)](
            q, k, v, do, lse, delta, dk_h, dv_h, cu, scale, n, h, h // g, q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), dk_h.stride(0), dk_h.stride(1), CAUSAL=causal, D=d, BLOCK_M=bm, BLOCK_N=bn)
        _flash_attn_bwd_dq_kernel[_grid(max_seqlen, bm, n_seqs, h)](
            q, k, v, do, lse, delta, dq, cu, scale, n, h, h // g, q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), CAUSAL=causal, D=d, BLOCK_M=bm, BLOCK_N=bn)
        dk = dk_h.view(n, g, h // g, d).sum(2, dtype=torch.float32).to(k.dtype)  # (N, G, D)
        dv = dv_h.view(n, g, h // g, d).sum(2, dtype=torch.float32).to(v.dtype)
        return dq, dk, dv, None, None, None, None, None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                    max_seqlen: int | None = None, causal: bool = True, scale: float | None = None,
                    blocks: tuple[int, int] = (64, 64)) -> torch.Tensor:
    """q (N, H, D), k / v (N, G, D), cu_seqlens (S+1,) int32 document bounds, max_seqlen (computed when
    None) -> (N, H, D) in q's dtype (fp32 statistics). D a power of two >= 16; ``blocks`` (BLOCK_M,
    BLOCK_N) powers of two >= 16. Raises ValueError for H % G != 0 or an unsupported D."""
    h, d = q.shape[1:]
    if h % k.shape[1]:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({k.shape[1]})")
    if d < 16 or d & (d - 1):
        raise ValueError(f"flash_attention head dim ({d}) must be a power of two >= 16")
    k, v = k.to(q.dtype), v.to(q.dtype)  # tl.dot needs equal operand dtypes (autocast may mix them)
    if os.environ.get("TRITON_INTERPRET", "0") == "1" and q.dtype != torch.float32:
        # Triton 3.9's CPU interpreter computes 16-bit tl.dot wrongly: run it in fp32 there
        return flash_attention(q.float(), k.float(), v.float(), cu_seqlens, max_seqlen, causal, scale,
                               blocks).to(q.dtype)
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    if max_seqlen is None:
        max_seqlen = int((cu[1:] - cu[:-1]).max())
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    return FlashAttentionFunction.apply(q, k, v, cu, max_seqlen, causal, scale, blocks)


def flash_attention_bhtd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         blocks: tuple[int, int] = (64, 64), documents: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention in the model's layout: q (B, H, T, D), k / v (B, G, T, D) -> (B, H, T, D);
    each of the B sequences is one document, or with ``documents`` (B, T) ids each packed document
    (``cu_seqlens`` from the ids). Raises like ``flash_attention``."""
    b, h, t, d = q.shape
    if documents is None:
        cu = torch.arange(0, (b + 1) * t, t, dtype=torch.int32, device=q.device)  # (B+1,)
    else:
        cu = cu_seqlens_of(documents.to(q.device))  # (S+1,)
    pack = lambda x: x.transpose(1, 2).reshape(b * t, x.shape[1], d)
    max_len = t if documents is None else int((cu[1:] - cu[:-1]).max())
    out = flash_attention(pack(q), pack(k), pack(v), cu, max_len, True, None, blocks)  # (B*T, H, D)
    return out.view(b, t, h, d).transpose(1, 2)
