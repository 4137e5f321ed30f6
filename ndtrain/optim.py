"""AdamW, learning-rate schedules and global gradient-norm clipping.

* AdamW: decoupled weight decay (Loshchilov & Hutter 2019), not applied to 1-D parameters (norm
  weights, biases). Parameters are held in fp32 (or fp64) and act as the master weights; bf16 runs
  compute under autocast.
* Schedules: linear warmup then cosine decay to ``min_lr_ratio * lr`` (GPT-3 / Llama practice), or
  warmup-stable-decay (WSD; Hu et al. 2024, MiniCPM): constant after warmup, then linear decay to the
  floor over the last ``decay_fraction`` of steps.
* Clipping: the global L2 norm over every gradient element of the model, counted exactly once
  across all ranks (``sum_sq`` contributions are summed over the axes where gradients are sharded),
  and one clip coefficient applied everywhere (Pascanu et al. 2013). The cross-rank sum is injected
  by the caller (``reduce_sum``), so this module never touches process groups.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import nn

from ndtrain.config import TrainingConfig


def param_groups(params: Iterable[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    """Split named parameters into decayed (>= 2-D) and non-decayed (1-D) groups."""
    decay, no_decay, seen = [], [], set()
    for _, p in params:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def fused_adamw_ok(params: list[torch.Tensor]) -> bool:
    """True when torch's fused AdamW (one kernel per tensor for the whole update) takes ``params``:
    plain floating-point tensors on CPU or CUDA. Tensor subclasses (DTensor) and other devices get
    the foreach implementation."""
    return bool(params) and all(type(p) in (nn.Parameter, torch.Tensor) and p.is_floating_point()
                                and p.device.type in ("cpu", "cuda") for p in params)


def build_optimizer(named_params, cfg: TrainingConfig, eager_state: bool = False) -> torch.optim.Optimizer:
    """AdamW over ``named_params`` with the config's betas, eps and weight decay.

    torch's fused implementation where ``fused_adamw_ok`` (on CPU ~4x less time than foreach, which
    makes one pass over memory per elementary op; the same update up to float rounding, ~1e-7
    relative in float32), else foreach. A loaded optimizer state dict brings its own choice (torch
    restores param-group options), so a run resumed from an older checkpoint keeps foreach.

    ``eager_state``: create every parameter's state now (step 0, zero moments: exactly what the
    first ``step()`` would create), so optimizer state dicts exist before step 1 (sharded layouts
    present them as views that a checkpoint load writes into).
    """
    groups = param_groups(named_params, cfg.weight_decay)
    impl = {"fused": True} if fused_adamw_ok([p for g in groups for p in g["params"]]) else {"foreach": True}
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **impl)
    if eager_state:
        # AdamW's own step counter as its first step() makes it: fused, fp32 on the parameter's
        # device; foreach, on the CPU, fp32 (fp64 under a fp64 default dtype)
        step_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        for g in opt.param_groups:
            for p in g["params"]:
                step = (torch.zeros((), dtype=torch.float32, device=p.device) if g["fused"]
                        else torch.tensor(0.0, dtype=step_dtype))
                opt.state[p] = {"step": step,
                                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
    return opt


def lr_factor(step: int, cfg: TrainingConfig) -> float:
    """Multiplier of ``cfg.lr`` for optimizer step ``step`` (0-based)."""
    floor = cfg.min_lr_ratio
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "wsd":
        decay_steps = max(1, round(cfg.decay_fraction * cfg.steps))
        start = cfg.steps - decay_steps
        if step < start:
            return 1.0
        frac = min(1.0, (step - start + 1) / decay_steps)
        return 1.0 - (1.0 - floor) * frac
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainingConfig):
    """LambdaLR whose ``last_epoch`` counts optimizer steps; its state is checkpointed."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg))


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
