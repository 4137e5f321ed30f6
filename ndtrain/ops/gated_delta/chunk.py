"""Chunked gated delta rule with the UT transform (WY representation of a product of Householder-
like updates; Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule over
Sequence Length", sec. 3; gated form: Yang, Kautz & Hatamizadeh 2024, sec. 3.3).

Inside a chunk with cumulative log decay g (gamma_i = e^(g_i)), the pseudo-values
u_i = b_i (v_i - (a_i S_{i-1})^T k_i) satisfy the unit lower-triangular system

    (I + A) U = diag(b) V - diag(b * gamma) K S_prev,   A_ij = b_i (gamma_i / gamma_j) k_i . k_j, j < i

so U = U~ - W S_prev with U~ = (I + A)^-1 diag(b) V and W = (I + A)^-1 diag(b gamma) K, computed for
all chunks at once by one triangular solve. Then

    O = diag(gamma) Q S_prev + ((Q K^T) * D) U,    D_ij = gamma_i / gamma_j for j <= i
    S = gamma_C S_prev + (K * gamma_C / gamma)^T U

and only the K x V state is carried from chunk to chunk.
"""
from __future__ import annotations

import torch

from ndtrain.ops.linear_attn.chunk import chunk_decays, chunk_pad, chunk_segments, chunk_view


def chunk_gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
                      beta: torch.Tensor, initial_state: torch.Tensor | None = None,
                      chunk_size: int = 64, resets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``naive_gated_delta``'s contract chunk by chunk, ``chunk_size`` C >= 1 (padded tokens have b = 0,
    g = 0); ``resets`` (B, T) bool document starts (every decay crossing one is 0, as in
    ``ops.linear_attn.chunk``). Raises ValueError for chunk_size < 1."""
    dt, c, n_pad, qc, kc, vc, g = chunk_view(q, k, v, log_decay, chunk_size)
    b, h, t, dk = k.shape
    dv, n = v.shape[-1], qc.shape[2]
    bc = chunk_pad(beta.to(dt), n_pad).view(b, h, n, c, 1)  # (B, H, N, C, 1)
    # gamma_i / gamma_j on and below the diagonal (B, H, N, C, C), gamma_i, gamma_C / gamma_j, gamma_C
    dmat, from_start, to_end, whole = chunk_decays(g, chunk_segments(resets, n_pad, n, c))
    strict = torch.ones(c, c, dtype=torch.bool, device=v.device).tril(-1)
    a = ((bc * kc) @ kc.transpose(-1, -2) * dmat).masked_fill(~strict, 0.0)  # (B, H, N, C, C)
    eye = torch.eye(c, dtype=dt, device=v.device)
    rhs = torch.cat([bc * vc, bc * from_start[..., None] * kc], dim=-1)  # (B, H, N, C, V + K)
    sol = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
    u_tilde, w = sol[..., :dv], sol[..., dv:]  # (B, H, N, C, V), (B, H, N, C, K)
    qk = (qc @ kc.transpose(-1, -2)) * dmat  # (B, H, N, C, C)
    k_to_end = kc * to_end[..., None]  # (B, H, N, C, K)
    state = (torch.zeros(b, h, dk, dv, dtype=dt, device=v.device) if initial_state is None
             else initial_state.to(dt))
    outs = []
    # Per-chunk views by one unbind (indexing [:, :, i] in the loop costs O(T^2 / C) in the backward:
    # each chunk's SelectBackward writes a zero gradient of the whole tensor).
    ut, wc, qg, qk_c, kend = (x.unbind(2) for x in (u_tilde, w, qc * from_start[..., None], qk, k_to_end))
    end_decay = whole.unbind(2)  # N x (B, H)
    for i in range(n):  # only the K x V state crosses chunk boundaries
        u = ut[i] - wc[i] @ state  # (B, H, C, V)
        outs.append(qg[i] @ state + qk_c[i] @ u)
        state = state * end_decay[i][..., None, None] + kend[i].transpose(-1, -2) @ u
    o = torch.stack(outs, dim=2).reshape(b, h, n * c, dv)[:, :, :t]  # (B, H, T, V)
    return o.to(v.dtype), state
