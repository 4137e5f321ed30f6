"""Reference GeLU with the tanh approximation (Hendrycks & Gimpel 2016, "Gaussian Error Linear Units").

``gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``, the form GPT-2 used; PyTorch's
``F.gelu(x, approximate="tanh")`` computes the same function.
"""
from __future__ import annotations

import math

import torch

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
CUBIC = 0.044715


def naive_gelu(x: torch.Tensor) -> torch.Tensor:
    """Elementwise tanh-GeLU written out from the formula. x (...) -> (...), same dtype."""
    return 0.5 * x * (1.0 + torch.tanh(SQRT_2_OVER_PI * (x + CUBIC * x.pow(3))))
