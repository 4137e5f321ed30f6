"""The declared interfaces between the trainer and the parallel layer.

``parallelize()`` returns a ``ParallelPlan`` whose ``grad_sync`` implements ``GradSync``; every data
parallel flavour (DDP, ZeRO-1/2, ZeRO-3 / FSDP / HSDP, expert data parallel) implements it, so the
trainer never asks which one it holds.
"""
from __future__ import annotations

import contextlib
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class GradSync(Protocol):
    """Gradient synchronisation, clipping and state dicts of one rank's (possibly sharded) model."""

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Context in which backward accumulates gradients locally (every microbatch but the last)."""

    def finish_grad_sync(self) -> None:
        """Wait for / issue the remaining gradient reductions after the last backward of a step."""

    def build_optimizer(self, tcfg) -> torch.optim.Optimizer:
        """The AdamW over what this rank steps (fp32 master shards under ZeRO)."""

    def clip_grad_norm(self, max_norm: float, mesh=None) -> float:
        """Global-norm clipping over every rank's gradients; returns the norm before clipping."""

    def model_state_dict(self) -> dict:
        """Parameters and persistent buffers under global names (DTensor shards where sharded)."""

    def load_model_state_dict(self, sd: dict) -> None: ...

    def optim_state_dict(self, optimizer: torch.optim.Optimizer) -> dict: ...

    def load_optim_state_dict(self, optimizer: torch.optim.Optimizer, sd: dict) -> None: ...
