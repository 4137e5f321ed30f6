"""Global gradient-norm clipping (Pascanu et al. 2013): the L2 norm over every gradient element of the
model, counted exactly once across all ranks (``sum_sq`` contributions are summed over the axes where
gradients are sharded), and one clip coefficient applied everywhere. The cross-rank sum is injected by
the caller (``reduce_sum``), so this module never touches process groups."""
from __future__ import annotations

from collections.abc import Callable

import torch

SHARD_AXES_ATTR = "ndtrain_shard_axes"


def shard_axes(p: torch.Tensor) -> tuple[str, ...]:
    """Mesh axes a parameter (or gradient shard) is split over; () when replicated.

    Parallel transforms tag what they shard: ``setattr(p, SHARD_AXES_ATTR, ("tp",))``. Pipeline
    stages hold disjoint parameters, so their tag includes "pp".
    """
    return getattr(p, SHARD_AXES_ATTR, ())


def clip_coefficient(norm: float, max_norm: float) -> float:
    """Factor the gradients are multiplied by: ``max_norm / (norm + 1e-6)`` when ``norm`` exceeds
    ``max_norm`` > 0, else 1.0 (0 disables clipping). Anything clipping part of the gradients
    elsewhere (the pipeline's tied head) uses this same factor."""
    return max_norm / (norm + 1e-6) if max_norm > 0 and norm > max_norm else 1.0


# CPU norm reductions accumulate each tensor in its own dtype, front to back: an fp32 norm of a
# 2M-element gradient is off by ~3e-5 relative. Norms of 64K-element slices, squared and summed in
# float64, are within ~2e-7 of the float64 norm at ~1.3x the cost of whole-tensor fp32 norms (and
# ~1/4 of float64 accumulation). GPU reductions are blocked trees: whole tensors are accurate.
_CPU_NORM_SLICE = 2**16


def grad_sum_sq(grads: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of every element of ``grads``, as a float64 (1,) tensor on their device.

    Per-tensor L2 norms come from ``torch._foreach_norm`` in the gradients' own dtype (float64
    stays float64, exact to rounding; float32 per 64K-element slice on CPU, whole tensors on GPU;
    bf16 / fp16 accumulate in float32), then are squared and summed in float64: float32 gradients
    give a norm within ~1e-6 relative of the float64 one (``torch.nn.utils.clip_grad_norm_``'s
    whole-tensor float32 norms are off by ~1e-5 at 2M elements on CPU). Empty list: 0.
    """
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g.detach())
    norms: list[torch.Tensor] = []
    for dtype, gs in by_dtype.items():
        acc = None if dtype in (torch.float32, torch.float64) else torch.float32
        if gs[0].device.type == "cpu":
            gs = [s for g in gs for s in g.reshape(-1).split(_CPU_NORM_SLICE)]
        norms.extend(torch._foreach_norm(gs, 2, dtype=acc))
    if not norms:
        return torch.zeros(1, dtype=torch.float64)
    return torch.stack(norms).to(torch.float64).pow(2).sum().reshape(1)


@torch.no_grad()
def clip_grad_norm(items: list[tuple[torch.Tensor, tuple[str, ...]]], max_norm: float,
                   reduce_sum: Callable[[torch.Tensor, tuple[str, ...]], None] | None = None,
                   uncounted: list[torch.Tensor] = ()) -> float:
    """Clip gradients in place to global L2 norm ``max_norm``; return the norm before clipping.

    Args:
        items: ``(grad, axes)`` pairs of this rank: ``grad`` is what this rank holds (a shard
            without padding, or a full replicated tensor) and ``axes`` the mesh axes it is split
            over. Elements are then counted exactly once: squared norms are summed over ``axes``
            (grouped by identical ``axes`` so each group needs one reduction), and a replicated
            tensor is counted once, not once per replica.
        max_norm: threshold; 0 disables clipping (the norm is still computed).
        reduce_sum: ``reduce_sum(sq, axes)`` sums the float64 (1,) tensor ``sq`` in place over the
            mesh axes ``axes`` (``ndtrain.parallel.dp.grad_sync.sum_over_axes(mesh)``); called for
            every group, also with ``axes == ()``, in the same order on every rank. None: one
            process, nothing to sum (raises ValueError if any ``axes`` are given).
        uncounted: gradients scaled by the same coefficient but left out of the norm (a copy of
            a gradient counted elsewhere: a pipeline's last-stage tied head).
    Precision (``grad_sum_sq``): float64 gradients give the float64 norm (1e-6 parity tests hold);
    float32 ones a norm within ~1e-6 relative of it. Every rank ends with the same norm and the
    same clip coefficient.
    """
    by_axes: dict[tuple[str, ...], list[torch.Tensor]] = {}
    for g, axes in items:
        by_axes.setdefault(tuple(axes), []).append(g)
    device = items[0][0].device if items else torch.device("cpu")
    total = torch.zeros(1, dtype=torch.float64, device=device)
    for axes in sorted(by_axes):  # same order on every rank
        sq = grad_sum_sq(by_axes[axes])
        if reduce_sum is not None:
            reduce_sum(sq, axes)
        elif axes:
            raise ValueError(f"gradients split over {axes} need a reduce_sum")
        total += sq
    norm = total.sqrt().item()
    coef = clip_coefficient(norm, max_norm)
    grads = [g for g, _ in items] + list(uncounted)
    if coef != 1.0 and grads:  # _foreach_mul_ rejects an empty list
        torch._foreach_mul_(grads, coef)
    return norm
