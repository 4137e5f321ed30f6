"""Reference row softmax, written out: subtract the row max (for range), exponentiate, normalise."""
from __future__ import annotations

import torch


def naive_softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim. x (..., N) -> (..., N), same dtype; computed in fp32."""
    xf = x.float()
    e = torch.exp(xf - xf.amax(-1, keepdim=True))
    return (e / e.sum(-1, keepdim=True)).to(x.dtype)
