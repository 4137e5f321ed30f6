"""What the chunked (PyTorch) and Triton fused linear + cross-entropy share: the shape check, the
trimming of vocabulary padding, and the ``combine`` signature of the vocab-parallel variant."""
from __future__ import annotations

from collections.abc import Callable

import torch

# (max, sumexp, target logit), each (N,), of this rank's vocabulary rows -> the tp-wide statistics
Combine = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def check_shapes(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> None:
    """Raise ValueError unless h (N, C), weight (V, C), labels (N,)."""
    if h.dim() != 2 or weight.dim() != 2 or h.shape[1] != weight.shape[1] or labels.shape != h.shape[:1]:
        raise ValueError(f"linear cross-entropy shapes h {tuple(h.shape)}, weight {tuple(weight.shape)}, "
                         f"labels {tuple(labels.shape)} do not match (N, C), (V, C), (N,)")


def trim_padded_rows(weight: torch.Tensor, vocab_start: int, vocab_size: int | None) -> torch.Tensor:
    """The rows of ``weight`` (global ids from ``vocab_start``) below ``vocab_size``: padded rows
    never enter a block, so they get no probability and a zero gradient."""
    if vocab_size is not None and vocab_start + weight.shape[0] > vocab_size:
        return weight[:max(0, vocab_size - vocab_start)]
    return weight
