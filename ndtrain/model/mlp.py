"""SwiGLU feed-forward (Shazeer 2020, "GLU Variants Improve Transformer"), as in Llama 3 (2024)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _silu_gate(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.silu(a) * b  # (B, T, F)


class FeedForward(nn.Module):
    """``w2(silu(w1 x) * w3 x)`` (gate, up, down; no biases): x (B, T, C) -> (B, T, C), hidden F =
    ``ModelConfig.ffn_dim``. No shape is hard-coded, so tp may shard F."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)  # gate (F, C)
        self.w3 = nn.Linear(dim, hidden, bias=False)  # up   (F, C)
        self.w2 = nn.Linear(hidden, dim, bias=False)  # down (C, F)
        # the gate (a, b) -> silu(a) * b; ndtrain.model.kernels may swap in a fused kernel
        self.gate = _silu_gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.gate(self.w1(x), self.w3(x)))  # (B, T, F) -> (B, T, C)
