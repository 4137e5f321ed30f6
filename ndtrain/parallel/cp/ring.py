"""Ring attention (Liu, Zaharia & Abbeel 2023): exact attention over a sequence split across ``cp``,
K/V blocks passed around the ring (docs/context_parallel.md, "Ring attention").

Each step sends the held K/V block on (``batch_isend_irecv``) while computing it, and merges in fp32
(fp64 for fp64 inputs):

    lse' = logaddexp(lse, lse_b);   out' = out * exp(lse - lse') + out_b * exp(lse_b - lse')

Fully masked blocks are skipped but forwarded. Backward (FlashAttention-2 style, Dao 2023)
recomputes P from the final lse and ``delta = rowsum(dO * O)``; dK/dV travel with K/V back home.
Visibility: (not causal or pos_k <= pos_q) and equal document ids. K and V travel as one
(B, G, T_l, D + Dv) message. Bytes per rank: forward (cp-1) blocks, backward (cp-1) blocks + cp
dK/dV blocks. Slow twin: full attention on the gathered sequence."""
from __future__ import annotations

import math

import torch

from ndtrain.mesh import AxisGroup
from ndtrain.parallel.cp.collectives import ring_exchange

NEG_INF = float("-inf")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of the softmax statistics: fp64 for fp64 inputs, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def block_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, q_doc: torch.Tensor | None = None,
               k_doc: torch.Tensor | None = None) -> torch.Tensor | None:
    """q_pos (Tq,), k_pos (Tk,), docs (B, Tq) / (B, Tk) or None -> bool (1 or B, 1, Tq, Tk), True =
    attend, or None when everything is visible."""
    mask = None
    if causal:
        mask = (k_pos[None, :] <= q_pos[:, None])[None, None]  # (1, 1, Tq, Tk)
    if q_doc is not None:
        same = (q_doc[:, :, None] == k_doc[:, None, :])[:, None]  # (B, 1, Tq, Tk)
        mask = same if mask is None else mask & same
    return mask


def _finite(lse: torch.Tensor) -> torch.Tensor:
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def _expand(kv: torch.Tensor, heads: int) -> torch.Tensor:
    g = kv.shape[1]
    return kv if g == heads else kv.repeat_interleave(heads // g, dim=1)  # (B, H, Tk, D)


def block_forward(q, k, v, mask, scale):
    """q (B, H, Tq, D) against one block k (B, G, Tk, D), v (B, G, Tk, Dv) -> (out (B, H, Tq, Dv),
    lse (B, H, Tq)); rows with no visible key get lse = -inf, out = 0."""
    h = q.shape[1]
    s = torch.matmul(q, _expand(k, h).transpose(-1, -2)) * scale  # (B, H, Tq, Tk)
    if mask is not None:
        s = s.masked_fill(~mask, NEG_INF)
    lse = torch.logsumexp(s, dim=-1)  # (B, H, Tq)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    return torch.matmul(p, _expand(v, h)), lse


def merge(out, lse, blk_out, blk_lse):
    """Online-softmax merge of two partial attentions over disjoint key sets (-inf safe)."""
    new = torch.logaddexp(lse, blk_lse)  # (B, H, Tq)
    fin = _finite(new).unsqueeze(-1)
    return out * torch.exp(lse.unsqueeze(-1) - fin) + blk_out * torch.exp(blk_lse.unsqueeze(-1) - fin), new


def block_backward(dout, q, k, v, lse, delta, mask, scale):
    """One block's gradients from the final lse and delta (B, H, Tq) -> dq (B, H, Tq, D), dk
    (B, G, Tk, D), dv (B, G, Tk, D)."""
    b, h, _, d = q.shape
    g, tk = k.shape[1], k.shape[2]
    ke, ve = _expand(k, h), _expand(v, h)
    s = torch.matmul(q, ke.transpose(-1, -2)) * scale  # (B, H, Tq, Tk)
    if mask is not None:
        s = s.masked_fill(~mask, NEG_INF)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), dout)  # (B, H, Tk, D)
    ds = p * (torch.matmul(dout, ve.transpose(-1, -2)) - delta.unsqueeze(-1))
    dq = torch.matmul(ds, ke) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q) * scale  # (B, H, Tk, D)
    if g != h:
        dk = dk.view(b, g, h // g, tk, d).sum(2)  # (B, G, Tk, D)
        dv = dv.view(b, g, h // g, tk, dv.shape[-1]).sum(2)  # (B, G, Tk, Dv)
    return dq, dk, dv


def _mask_for(ctx_like, src: int):
    q_pos, kv_pos, q_doc, kv_doc, causal = ctx_like
    return block_mask(q_pos, kv_pos[src], causal, q_doc, None if kv_doc is None else kv_doc[src])


def _visible(mask) -> bool:
    return mask is None or bool(mask.any())


class RingAttentionFunction(torch.autograd.Function):
    """Ring attention over ``group``. fwd: (cp-1) K/V send/recv; bwd: (cp-1) K/V + cp dK/dV."""

    @staticmethod
    def forward(ctx, q, k, v, group: AxisGroup, q_pos, kv_pos, q_doc, kv_doc, causal: bool, scale: float):
        n, r = group.size, group.rank
        cdt = compute_dtype(q.dtype)
        meta = (q_pos, kv_pos, q_doc, kv_doc, causal)
        qc = q.to(cdt)
        out = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=cdt, device=q.device)  # (B, H, Tq, Dv)
        lse = torch.full(q.shape[:-1], NEG_INF, dtype=cdt, device=q.device)  # (B, H, Tq)
        dk = k.shape[-1]
        kv = torch.cat([k, v.to(k.dtype)], dim=-1)  # (B, G, Tk, Dk + Dv): one message per hop
        for s in range(n):
            src = (r - s) % n
            works = None
            if s < n - 1:
                nxt, works = ring_exchange(kv, group, tag=0)  # overlaps the block below
            mask = _mask_for(meta, src)
            if _visible(mask):
                blk_out, blk_lse = block_forward(qc, kv[..., :dk].to(cdt), kv[..., dk:].to(cdt), mask, scale)
                out, lse = merge(out, lse, blk_out, blk_lse)
            if works:
                for w in works:
                    w.wait()
                kv = nxt
        ctx.save_for_backward(q, k, v, out, lse, q_pos, kv_pos, q_doc, kv_doc)
        ctx.group, ctx.causal, ctx.scale = group, causal, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, q_pos, kv_pos, q_doc, kv_doc = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        n, r = group.size, group.rank
        cdt = out.dtype
        meta = (q_pos, kv_pos, q_doc, kv_doc, ctx.causal)
        qc, doc = q.to(cdt), dout.to(cdt)
        delta = (doc * out).sum(-1)  # (B, H, Tq)
        dq = torch.zeros_like(qc)
        dk = k.shape[-1]
        kv = torch.cat([k, v.to(k.dtype)], dim=-1)  # (B, G, Tk, Dk + Dv)
        acc = acc_works = acc_recv = None
        for s in range(n):
            src = (r - s) % n
            kv_works = None
            if s < n - 1:
                kv_next, kv_works = ring_exchange(kv, group, tag=1)
            contrib = torch.zeros(kv.shape, dtype=cdt, device=kv.device)  # (B, G, Tk, Dk + Dv): [dK | dV]
            mask = _mask_for(meta, src)
            if _visible(mask):
                dq_b, dk_b, dv_b = block_backward(doc, qc, kv[..., :dk].to(cdt), kv[..., dk:].to(cdt), lse,
                                                  delta, mask, scale)
                dq += dq_b
                contrib[..., :dk], contrib[..., dk:] = dk_b, dv_b
            if acc_works:  # dK/dV of block src accumulated by the ranks before us
                for w in acc_works:
                    w.wait()
                contrib += acc_recv
            acc = contrib
            if n > 1:  # pass the accumulator on; after the last step it reaches the block's owner
                acc_recv, acc_works = ring_exchange(acc, group, tag=2)
            if kv_works:
                for w in kv_works:
                    w.wait()
                kv = kv_next
        if n > 1:
            for w in acc_works:
                w.wait()
            acc = acc_recv
        return (dq.to(q.dtype), acc[..., :dk].to(k.dtype), acc[..., dk:].to(v.dtype)) + (None,) * 7


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: AxisGroup, q_pos: torch.Tensor,
                   kv_pos: torch.Tensor, causal: bool = True, q_doc: torch.Tensor | None = None,
                   kv_doc: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Exact attention of this rank's queries to every rank's keys.

    Args:
        q: (B, H, Tq, D); k: (B, G, Tk, D), v: (B, G, Tk, Dv) (H % G == 0; Dv may differ, as in MLA).
        group: the ``cp`` AxisGroup (size 1 = plain blockwise attention).
        q_pos: (Tq,) int64 positions; kv_pos: (cp, Tk) every rank's positions (row i = rank i).
        causal: mask later keys. q_doc, kv_doc: optional (B, Tq), (cp, B, Tk) document ids.
        scale: softmax scale, default 1 / sqrt(D).
    Returns (B, H, Tq, Dv) in q's dtype. Raises ValueError on inconsistent shapes."""
    if kv_pos.shape[0] != group.size or q.shape[1] % k.shape[1]:
        raise ValueError(f"kv_pos rows ({kv_pos.shape[0]}) must equal cp ({group.size}) and query heads "
                         f"({q.shape[1]}) be a multiple of kv heads ({k.shape[1]})")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return RingAttentionFunction.apply(q, k, v, group, q_pos, kv_pos, q_doc, kv_doc, causal, scale)


def simulate_ring_attention(q, k, v, q_pos, kv_pos, causal=True, q_doc=None, kv_doc=None, scale=None):
    """Single-process ring: the same block / merge / backward steps per rank, in ring order, on per-rank
    lists q[i] (B, H, Tq, D), k[i], v[i] (B, G, Tk, D); q_pos (cp, Tq), kv_pos (cp, Tk), docs
    (cp, B, T) or None. Returns (outs, backward) with ``backward(douts) -> (dqs, dks, dvs)``, dK/dV
    summed over every rank that used the block (as the travelling accumulators)."""
    n = len(q)
    scale = 1.0 / math.sqrt(q[0].shape[-1]) if scale is None else scale
    cdt = compute_dtype(q[0].dtype)
    metas = [(q_pos[i], kv_pos, None if q_doc is None else q_doc[i], kv_doc, causal) for i in range(n)]
    outs, lses = [], []
    for r in range(n):
        out = torch.zeros(q[r].shape[:-1] + v[0].shape[-1:], dtype=cdt)
        lse = torch.full(q[r].shape[:-1], NEG_INF, dtype=cdt)
        for s in range(n):
            src = (r - s) % n
            mask = _mask_for(metas[r], src)
            if _visible(mask):
                out, lse = merge(out, lse, *block_forward(q[r].to(cdt), k[src].to(cdt), v[src].to(cdt), mask, scale))
        outs.append(out)
        lses.append(lse)

    def backward(douts):
        dqs = [torch.zeros(x.shape, dtype=cdt) for x in q]
        acc_k = [torch.zeros(x.shape, dtype=cdt) for x in k]  # held by block owner index
        acc_v = [torch.zeros(x.shape, dtype=cdt) for x in v]
        for s in range(n):  # step s: rank r works on block (r - s) mod n, in ring order
            for r in range(n):
                src = (r - s) % n
                mask = _mask_for(metas[r], src)
                if _visible(mask):
                    delta = (douts[r].to(cdt) * outs[r]).sum(-1)
                    dq, dk, dv = block_backward(douts[r].to(cdt), q[r].to(cdt), k[src].to(cdt), v[src].to(cdt),
                                                lses[r], delta, mask, scale)
                    dqs[r] += dq
                    acc_k[src] += dk
                    acc_v[src] += dv
        return dqs, acc_k, acc_v

    return [o.to(q[0].dtype) for o in outs], backward
