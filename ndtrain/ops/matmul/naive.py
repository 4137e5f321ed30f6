"""Reference for the tiled matmul: ``act(a @ b + bias)`` in plain PyTorch."""
from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("none", "gelu", "silu", "relu")  # gelu is the tanh approximation


def naive_matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
                 activation: str = "none") -> torch.Tensor:
    """``act(a @ b + bias)``. a (M, K), b (K, N), bias (N,) or None -> (M, N).

    Raises ValueError for an activation outside ``ACTIVATIONS``.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} must be one of {ACTIVATIONS}")
    z = a @ b
    if bias is not None:
        z = z + bias
    if activation == "gelu":
        return F.gelu(z, approximate="tanh")
    if activation == "silu":
        return F.silu(z)
    if activation == "relu":
        return torch.relu(z)
    return z
