"""Chunked parallel form of (decayed) linear attention, the training path.

Within a chunk of C tokens the output is a masked, decay-weighted attention-like product (quadratic
in C only); across chunks only the K x V state is carried (Yang et al. 2024, "Gated Linear Attention
Transformers with Hardware-Efficient Training", sec. 3; Dao & Gu 2024, SSD block decomposition).
With g the cumulative log decay inside the chunk:

    O   = diag(e^g) Q S_prev + ((Q K^T) * D) V,    D_ij = e^(g_i - g_j) for j <= i, else 0
    S   = e^(g_C) S_prev + (K * e^(g_C - g))^T V

Packed documents: ``resets`` (B, T) bool marks each token that starts a document (the state is zeroed
just before it). In a chunk with r_i resets at or before token i, a term is kept only when it stays
inside one document: D_ij needs r_i = r_j, the S_prev term r_i = 0, the state update r_j = r_C and
the carried decay r_C = 0 (``chunk_decays``: masked before the exponential, so no inf or NaN appears).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ndtrain.ops.linear_attn.naive import compute_dtype


def chunk_pad(x: torch.Tensor, n_pad: int, dim: int = 2) -> torch.Tensor:
    """Zero-pad ``x`` by ``n_pad`` positions at the end of ``dim`` (padded tokens have k = v = 0 and
    log-decay 0, so they leave the state unchanged)."""
    if n_pad == 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, n_pad]
    return F.pad(x, pad)


def chunk_view(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor | None,
               chunk_size: int):
    """q, k (B, H, T, K), v (B, H, T, V), log_decay (B, H, T) | None -> (dt, c, n_pad, qc, kc, vc, g):
    (B, H, N, C, *) chunks in compute dtype ``dt``, C = min(chunk_size, T), ``n_pad`` tokens of
    padding, g (B, H, N, C) cumulative log decay. Raises ValueError for chunk_size < 1."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size ({chunk_size}) must be >= 1")
    dt = compute_dtype(v)
    b, h, t, _ = k.shape
    c = min(chunk_size, max(t, 1))
    n_pad = (-t) % c
    n = (t + n_pad) // c
    qc, kc, vc = (chunk_pad(x.to(dt), n_pad).view(b, h, n, c, -1) for x in (q, k, v))  # (B, H, N, C, *)
    if log_decay is None:
        g = torch.zeros(b, h, n, c, dtype=dt, device=v.device)
    else:
        g = chunk_pad(log_decay.to(dt), n_pad).view(b, h, n, c).cumsum(-1)  # (B, H, N, C)
    return dt, c, n_pad, qc, kc, vc, g


def decay_matrix(g: torch.Tensor, seg: torch.Tensor | None = None) -> torch.Tensor:
    """(..., C) cumulative log decays -> (..., C, C) with e^(g_i - g_j) on and below the diagonal, 0
    above (masked before the exponential so no inf appears, in the forward or the backward); with
    ``seg`` (..., C) document counts also 0 where seg_i != seg_j."""
    c = g.shape[-1]
    keep = torch.ones(c, c, dtype=torch.bool, device=g.device).tril()
    if seg is not None:
        keep = keep & (seg[..., :, None] == seg[..., None, :])  # (..., C, C)
    diff = g[..., :, None] - g[..., None, :]  # (..., C, C)
    return diff.masked_fill(~keep, float("-inf")).exp()


def chunk_segments(resets: torch.Tensor | None, n_pad: int, n: int, c: int) -> torch.Tensor | None:
    """resets (B, T) bool -> (B, 1, N, C) int64 resets at or before each token of its chunk (padding:
    none), or None without resets."""
    if resets is None:
        return None
    r = chunk_pad(resets.to(torch.int64), n_pad, dim=1)  # (B, N*C)
    return r.view(r.shape[0], 1, n, c).cumsum(-1)


def chunk_decays(g: torch.Tensor, seg: torch.Tensor | None):
    """The four decays of a chunk from g (B, H, N, C) and ``chunk_segments``: D (B, H, N, C, C), from
    the chunk start e^(g_i) (B, H, N, C), to its end e^(g_C - g_j) (B, H, N, C), whole e^(g_C) (B, H, N);
    each 0 where it would cross a document start."""
    ninf = float("-inf")
    start, to_end, whole = g, g[..., -1:] - g, g[..., -1]
    if seg is not None:
        start = start.masked_fill(seg > 0, ninf)
        to_end = to_end.masked_fill(seg != seg[..., -1:], ninf)
        whole = whole.masked_fill(seg[..., -1] > 0, ninf)
    return decay_matrix(g, seg), start.exp(), to_end.exp(), whole.exp()


def chunk_linear_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      log_decay: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                      chunk_size: int = 64, resets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``naive_linear_attn``'s contract (o (B, H, T, V), state (B, H, K, V)) computed chunk by chunk,
    ``chunk_size`` C >= 1 (any T); ``resets`` (B, T) bool document starts. Raises ValueError for
    chunk_size < 1."""
    dt, c, n_pad, qc, kc, vc, g = chunk_view(q, k, v, log_decay, chunk_size)
    b, h, t, dk = k.shape
    dv, n = v.shape[-1], qc.shape[2]
    dmat, from_start, to_end, whole = chunk_decays(g, chunk_segments(resets, n_pad, n, c))
    intra = (qc @ kc.transpose(-1, -2)) * dmat  # (B, H, N, C, C)
    k_to_end = kc * to_end[..., None]  # (B, H, N, C, K)
    state = (torch.zeros(b, h, dk, dv, dtype=dt, device=v.device) if initial_state is None
             else initial_state.to(dt))
    outs = []
    # Per-chunk views by one unbind: indexing [:, :, i] in the loop makes each chunk's backward write
    # a zero gradient of the whole tensor (O(T^2 / C) in the backward; 80% of a step at T = 8192).
    qg, intra_c, v_c, kend = (x.unbind(2) for x in (qc * from_start[..., None], intra, vc, k_to_end))
    end_decay = whole.unbind(2)  # N x (B, H)
    for i in range(n):  # only the K x V state crosses chunk boundaries
        o = qg[i] @ state + intra_c[i] @ v_c[i]  # (B, H, C, V)
        outs.append(o)
        state = state * end_decay[i][..., None, None] + kend[i].transpose(-1, -2) @ v_c[i]
    o = torch.stack(outs, dim=2).reshape(b, h, n * c, dv)[:, :, :t]  # (B, H, T, V)
    return o.to(v.dtype), state
