"""Reference SwiGLU gate (Shazeer 2020, "GLU Variants Improve Transformer"): ``silu(a) * b``."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` with a the gate projection, b the up projection: (..., F), (..., F) -> (..., F).

    Exactly what ``ndtrain.model.mlp.FeedForward`` computes between its projections in eager mode.
    """
    return F.silu(a) * b
