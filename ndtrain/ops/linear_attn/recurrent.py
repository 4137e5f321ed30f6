"""One decoding step of (decayed) linear attention with a fixed-size state (the RNN view of
Katharopoulos et al. 2020; Mamba-2's recurrent mode, Dao & Gu 2024)."""
from __future__ import annotations

import torch

from ndtrain.ops.linear_attn.naive import compute_dtype


def recurrent_linear_attn_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               log_decay: torch.Tensor | None,
                               state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Advance the state by one token.

    Args: q, k (B, H, K); v (B, H, V); log_decay (B, H) or None; state (B, H, K, V) or None (zeros).
    Returns: o (B, H, V) in v's dtype, the new state (B, H, K, V) in fp32 (fp64 for fp64 inputs).
    """
    dt = compute_dtype(v)
    kv = torch.einsum("bhk,bhv->bhkv", k.to(dt), v.to(dt))  # (B, H, K, V)
    if state is None:
        state = kv
    else:
        state = state.to(dt)
        if log_decay is not None:
            state = state * log_decay.to(dt).exp()[..., None, None]
        state = state + kv
    o = torch.einsum("bhk,bhkv->bhv", q.to(dt), state)  # (B, H, V)
    return o.to(v.dtype), state
