"""Reference: materialise the logits ``h @ W^T`` (N, V) and take PyTorch's cross-entropy."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               ignore_index: int = -100) -> torch.Tensor:
    """Per-token losses. h (N, C), weight (V, C), labels (N,) int -> (N,) fp32, 0 where ignored."""
    logits = (h @ weight.t()).float()  # (N, V)
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="none")
