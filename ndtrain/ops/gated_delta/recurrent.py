"""One decoding step of the gated delta rule with a fixed K x V state per head (Yang et al. 2024),
in the rank-one form: decay, read the memory at k, write b (v - S^T k) at k."""
from __future__ import annotations

import torch

from ndtrain.ops.linear_attn.naive import compute_dtype


def recurrent_gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor | None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Args: q, k (B, H, K); v (B, H, V); log_decay, beta (B, H); state (B, H, K, V) or None (zeros).

    Returns: o (B, H, V) in v's dtype, the new state (B, H, K, V) in fp32 (fp64 for fp64 inputs).
    """
    dt = compute_dtype(v)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    if state is None:
        state = torch.zeros(*k.shape, v.shape[-1], dtype=dt, device=v.device)
    state = state.to(dt) * log_decay.to(dt).exp()[..., None, None]  # (B, H, K, V)
    recalled = torch.einsum("bhkv,bhk->bhv", state, k)  # what the memory returns at k
    delta = (v - recalled) * beta.to(dt)[..., None]  # (B, H, V)
    state = state + k[..., :, None] * delta[..., None, :]
    o = torch.einsum("bhkv,bhk->bhv", state, q)
    return o.to(v.dtype), state
