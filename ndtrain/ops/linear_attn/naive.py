"""Reference linear attention: the recurrence applied one token at a time (Katharopoulos et al.
2020, "Transformers are RNNs", eq. 16-18; with a decay, Dao & Gu 2024, "Transformers are SSMs", the
SSD recurrence h_t = a_t h_{t-1} + B_t x_t^T, y_t = h_t^T C_t)."""
from __future__ import annotations

import torch


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 for half-precision inputs (the state is accumulated in fp32), else x's dtype."""
    return torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype


def naive_linear_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      log_decay: torch.Tensor | None = None,
                      initial_state: torch.Tensor | None = None,
                      resets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``S_t = exp(g_t) S_{t-1} + k_t v_t^T``, ``o_t = S_t^T q_t``, token by token. q, k (B, H, T, K)
    (feature-mapped, unscaled), v (B, H, T, V), log_decay (B, H, T) g_t <= 0 or None, initial_state
    (B, H, K, V) or None, resets (B, T) bool (S_{t-1} = 0 at a document start) -> o (B, H, T, V) in
    v's dtype, S_T (B, H, K, V) fp32 (fp64 for fp64)."""
    dt = compute_dtype(v)
    b, h, t, dk = k.shape
    state = (torch.zeros(b, h, dk, v.shape[-1], dtype=dt, device=v.device) if initial_state is None
             else initial_state.to(dt))
    outs = []
    for i in range(t):
        if resets is not None:
            state = state * (~resets[:, i]).to(dt)[:, None, None, None]
        if log_decay is not None:
            state = state * log_decay[:, :, i, None, None].to(dt).exp()
        state = state + k[:, :, i, :, None].to(dt) * v[:, :, i, None, :].to(dt)  # (B, H, K, V)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, i].to(dt), state))
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(v.shape, dtype=dt)  # (B, H, T, V)
    return o.to(v.dtype), state
