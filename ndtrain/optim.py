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


def build_optimizer(named_params, cfg: TrainingConfig, eager_state: bool = False) -> torch.optim.Optimizer:
    """AdamW over ``named_params`` with the config's betas, eps and weight decay.

    ``eager_state``: create every parameter's state now (step 0, zero moments: exactly what the
    first ``step()`` would create), so optimizer state dicts exist before step 1 (sharded layouts
    present them as views that a checkpoint load writes into).
    """
    opt = torch.optim.AdamW(param_groups(named_params, cfg.weight_decay), lr=cfg.lr,
                            betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=True)
    if eager_state:
        # AdamW's own step counter: fp32, fp64 under a fp64 default dtype
        step_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        for g in opt.param_groups:
            for p in g["params"]:
                opt.state[p] = {"step": torch.tensor(0.0, dtype=step_dtype),
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


@torch.no_grad()
def clip_grad_norm(items: list[tuple[torch.Tensor, tuple[str, ...]]], max_norm: float,
                   reduce_sum: Callable[[torch.Tensor, tuple[str, ...]], None] | None = None) -> float:
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
    Sums of squares are kept in float64, so the norm is exact enough for 1e-6 parity tests, and
    every rank ends with the same norm and the same clip coefficient.
    """
    by_axes: dict[tuple[str, ...], list[torch.Tensor]] = {}
    for g, axes in items:
        by_axes.setdefault(tuple(axes), []).append(g)
    device = items[0][0].device if items else torch.device("cpu")
    total = torch.zeros(1, dtype=torch.float64, device=device)
    for axes in sorted(by_axes):  # same order on every rank
        # vector_norm accumulates in float64 without a float64 copy of each gradient (3x faster)
        norms = [torch.linalg.vector_norm(g.detach(), dtype=torch.float64) for g in by_axes[axes]]
        sq = torch.stack(norms).pow(2).sum().reshape(1)
        if reduce_sum is not None:
            reduce_sum(sq, axes)
        elif axes:
            raise ValueError(f"gradients split over {axes} need a reduce_sum")
        total += sq
    norm = total.sqrt().item()
    coef = clip_coefficient(norm, max_norm)
    if coef != 1.0 and items:  # _foreach_mul_ rejects an empty list
        torch._foreach_mul_([g for g, _ in items], coef)
    return norm
