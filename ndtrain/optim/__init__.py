"""Optimizers and what steps them: AdamW (``adamw``), Muon (``muon``: Newton-Schulz on the hidden
matrices, AdamW on the rest; its sharded step is ``ndtrain.parallel.muon``), learning-rate schedules
(``schedule``) and global-norm clipping (``clip``). No process groups here: cross-rank sums are
injected by the caller."""
from ndtrain.optim.adamw import build_optimizer, fused_adamw_ok, param_groups
from ndtrain.optim.clip import SHARD_AXES_ATTR, clip_coefficient, clip_grad_norm, grad_sum_sq, shard_axes
from ndtrain.optim.schedule import build_scheduler, lr_factor

__all__ = ["SHARD_AXES_ATTR", "build_optimizer", "build_scheduler", "clip_coefficient", "clip_grad_norm",
           "fused_adamw_ok", "grad_sum_sq", "lr_factor", "param_groups", "shard_axes"]
