"""RMSNorm (Zhang & Sennrich 2019), computed in float32 and cast back before the gain (as Llama and
HF), so bf16 activations keep an fp32-accurate normaliser."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x^2, -1) + eps) * weight``: x (..., C) -> (..., C), x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))  # (C,)
        # a fused kernel (x, weight, eps) -> y set from outside (ndtrain.model.kernels); None = eager
        self.fused = None

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused(x, self.weight, self.eps)
        xf = x.float()  # (..., C) fp32
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
