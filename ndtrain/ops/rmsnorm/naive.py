"""Reference RMSNorm (Zhang & Sennrich 2019), the exact arithmetic of ``ndtrain.model.norm.RMSNorm``:
normalise in fp32, cast back to x's dtype, then multiply by the gain in the promoted dtype."""
from __future__ import annotations

import torch


def naive_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x^2, -1) + eps))``. x (..., C), weight (C,) -> (..., C) in the
    promoted dtype of x and weight (as Hugging Face's LlamaRMSNorm)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)
