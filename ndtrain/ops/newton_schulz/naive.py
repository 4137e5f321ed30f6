"""Quintic Newton-Schulz iteration (Jordan et al. 2024, "Muon: An optimizer for hidden layers in
neural networks"; Bernstein & Newhouse 2024): an approximation of the orthogonal polar factor
``U V^T`` of ``G = U S V^T`` with matrix products only.

``X_0 = G / (||G||_F + eps)`` (all singular values in (0, 1]), then ``steps`` times

    A = X X^T,   X <- a X + (b A + c A A) X,   (a, b, c) = (3.4445, -4.7750, 2.0315)

on the wide orientation (rows <= cols, so ``A`` is the smaller Gram matrix; a tall input is
transposed there and back). Each step applies the odd polynomial ``f(s) = a s + b s^3 + c s^5`` to
every singular value and keeps the singular vectors, so the output is ``U f^steps(S / ||G||_F) V^T``
(``ns_scalar_map``). The coefficients trade exactness for speed: ``f'(0) = a`` lifts small singular
values ~3.4x a step, and after 5 steps every singular value of a well-conditioned input lies in
roughly [0.68, 1.13] instead of converging to 1 (the reference's band; tested in ``tests/ops``).

Precision: the reference runs in bfloat16 on GPU; ``dtype`` None keeps the input's dtype (the
run's dtype on CPU: float64 runs stay float64, so sharded and single-process runs compare to
1e-8). Batched: leading dims are independent matrices (stacked MoE experts (E, F, C)).
"""
from __future__ import annotations

import torch

NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7  # the reference's: a zero matrix (padding experts) stays zero instead of NaN


def newton_schulz(g: torch.Tensor, steps: int = 5, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Approximately orthogonalise each trailing (m, n) matrix of ``g`` (..., m, n).

    Args:
        g: (..., m, n), m, n >= 1; leading dims are a batch of independent matrices.
        steps: iterations (>= 0; 0 returns the normalised input).
        dtype: compute dtype (None: ``g.dtype``; the result is cast back to ``g.dtype``).
    Returns (..., m, n) in ``g.dtype``. Raises ValueError for fewer than 2 dims.
    """
    if g.dim() < 2:
        raise ValueError(f"newton_schulz needs a matrix (..., m, n), got shape {tuple(g.shape)}")
    a, b, c = NS_COEFFS
    x = g.to(dtype or g.dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + NS_EPS)
    for _ in range(steps):
        aa = x @ x.mT  # (..., m, m), m = the smaller side
        x = a * x + (b * aa + c * (aa @ aa)) @ x
    if tall:
        x = x.mT
    return x.to(g.dtype)


def ns_scalar_map(s: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """What ``steps`` iterations do to each normalised singular value ``s`` in [0, 1]: f^steps(s)."""
    a, b, c = NS_COEFFS
    for _ in range(steps):
        s = a * s + b * s**3 + c * s**5
    return s


def ns_flops(m: int, n: int, steps: int = 5, batch: int = 1) -> int:
    """Matmul FLOPs of ``newton_schulz`` on ``batch`` (m, n) matrices: per step, with p = min(m, n),
    q = max(m, n): X X^T (2 p^2 q), A A (2 p^3), B X (2 p^2 q)."""
    p, q = min(m, n), max(m, n)
    return batch * steps * (4 * p * p * q + 2 * p ** 3)
