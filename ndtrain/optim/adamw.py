"""AdamW: decoupled weight decay (Loshchilov & Hutter 2019), not applied to 1-D parameters (norm
weights, biases). Parameters are held in fp32 (or fp64) and act as the master weights; bf16 runs
compute under autocast.
"""
from __future__ import annotations

from collections.abc import Iterable

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
