"""The declared interfaces between the trainer and the parallel layer.

``parallelize()`` returns a ``ParallelPlan`` whose ``grad_sync`` implements ``GradSync``; every data
parallel flavour (DDP, ZeRO-1/2, ZeRO-3 / FSDP / HSDP, expert data parallel) implements it, so the
trainer never asks which one it holds.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


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


@dataclass
class ParallelPlan:
    """Everything layout-dependent the trainer needs, built once by ``parallelize`` (the trainer
    never asks which axes are on).

    Fields:
        model: this rank's model, or its pipeline stage, parallelized in place.
        grad_sync: its ``GradSync`` (DDP, ZeRO-1/2, ZeRO-3 / FSDP / HSDP or expert data parallel).
        batch: ``shard(inputs, labels)`` and ``loss_sum(logits, labels)`` (``ndtrain.parallel.batch``).
        state: the checkpoint adapter (``ndtrain.parallel.state.CheckpointAdapter``): whole tensors
            under global names, whatever the aliasing and layout.
        pipeline: ``StagePipeline`` running the microbatches of a step; with pp == 1 the whole
            model is its one stage (forward then backward per microbatch), so training has one path.
        sample_skip_reason: "" when rank 0 can generate alone after training, else why not.
    """

    model: nn.Module
    grad_sync: GradSync
    batch: Any
    state: Any
    pipeline: Any = None
    sample_skip_reason: str = ""

    @property
    def can_sample(self) -> bool:
        return not self.sample_skip_reason

    def shard(self, inputs: torch.Tensor, labels: torch.Tensor):
        """This rank's (inputs, labels, positions) of a (B, T) batch (see ``BatchPlan.shard``)."""
        return self.batch.shard(inputs, labels)

    def loss_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.batch.loss_sum(logits, labels)
