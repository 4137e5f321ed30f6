"""Learning-rate schedules: linear warmup then cosine decay to ``min_lr_ratio * lr`` (GPT-3 / Llama
practice), or warmup-stable-decay (WSD; Hu et al. 2024, MiniCPM): constant after warmup, then linear
decay to the floor over the last ``decay_fraction`` of steps."""
from __future__ import annotations

import math

import torch

from ndtrain.config import TrainingConfig


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
