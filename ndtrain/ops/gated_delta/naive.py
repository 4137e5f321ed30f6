"""Reference gated delta rule, written as the paper's matrix update (Yang, Kautz & Hatamizadeh
2024, "Gated Delta Networks", eq. 10) in the paper's orientation: S is V x K and

    S_t = a_t S_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T,    o_t = S_t q_t.

The returned state is transposed to the K x V layout the chunked and recurrent forms (and the
Qwen3-Next implementation in ``transformers``) keep."""
from __future__ import annotations

import torch

from ndtrain.ops.linear_attn.naive import compute_dtype


def naive_gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
                      beta: torch.Tensor, initial_state: torch.Tensor | None = None,
                      resets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule. q, k (B, H, T, K) (normalised and scaled by the caller), v
    (B, H, T, V), log_decay g_t = log a_t <= 0 and beta b_t in (0, 1) (B, H, T), initial_state
    (B, H, K, V) or None, resets (B, T) bool (S_{t-1} = 0 at a document start) -> o (B, H, T, V) in v's dtype, state (B, H, K, V) fp32 (fp64 for fp64)."""
    dt = compute_dtype(v)
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    eye = torch.eye(dk, dtype=dt, device=v.device)
    s = (torch.zeros(b, h, dv, dk, dtype=dt, device=v.device) if initial_state is None
         else initial_state.to(dt).transpose(-1, -2))  # (B, H, V, K)
    outs = []
    for i in range(t):
        ki, vi, qi = k[:, :, i].to(dt), v[:, :, i].to(dt), q[:, :, i].to(dt)  # (B, H, K|V)
        bi = beta[:, :, i].to(dt)[..., None, None]  # (B, H, 1, 1)
        ai = log_decay[:, :, i].to(dt).exp()[..., None, None]
        if resets is not None:
            s = s * (~resets[:, i]).to(dt)[:, None, None, None]
        erase = eye - bi * ki[..., :, None] * ki[..., None, :]  # (B, H, K, K)
        s = ai * (s @ erase) + bi * vi[..., :, None] * ki[..., None, :]  # (B, H, V, K)
        outs.append((s @ qi[..., None]).squeeze(-1))  # (B, H, V)
    o = torch.stack(outs, dim=2)  # (B, H, T, V)
    return o.to(v.dtype), s.transpose(-1, -2)
