"""The declared interfaces between the trainer and the parallel layer.

``parallelize()`` returns a ``ParallelPlan``: its ``grad_sync`` implements ``GradSync`` (DDP, ZeRO-1/2,
ZeRO-3 / FSDP / HSDP, expert data parallel), its ``outer`` implements ``OuterSync`` (DiLoCo's outer
step over ``dp_replicate``, or ``NoOuterSync``), and its fields say what else differs between
layouts. The trainer never asks which axes are on.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class GradSync(Protocol):
    """Gradient synchronisation, clipping and state dicts of one rank's (possibly sharded) model.

    ``norm_uncounted``: Parameters (those whose ``.grad`` the optimizer steps) scaled by the clip
    coefficient but left out of the norm -- a pipeline's last-stage copy of a tied embedding, whose
    gradient equals the first stage's after ``sync_tied_grads``; set by ``parallelize``.
    """

    norm_uncounted: tuple

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Context in which backward accumulates gradients locally (every microbatch but the last)."""

    def finish_grad_sync(self) -> None:
        """Wait for / issue the remaining gradient reductions after the last backward of a step."""

    def build_optimizer(self, tcfg) -> torch.optim.Optimizer:
        """The AdamW over what this rank steps (fp32 master shards under ZeRO)."""

    def clip_grad_norm(self, max_norm: float, mesh=None) -> float:
        """Global-norm clipping over every rank's gradients, each element counted once (calls
        ``ndtrain.optim.clip_grad_norm``); returns the norm before clipping."""

    def observe_memory(self, sampler) -> None:
        """Attach (None: detach) a ``MemorySampler`` called inside the synchroniser's hooks, where
        sharded layouts hold gathered parameters or gradient buckets; a no-op where none exist."""

    def model_state_dict(self) -> dict:
        """Parameters and persistent buffers under global names (DTensor shards where sharded)."""

    def load_model_state_dict(self, sd: dict) -> None: ...

    def optim_state_dict(self, optimizer: torch.optim.Optimizer) -> dict: ...

    def load_optim_state_dict(self, optimizer: torch.optim.Optimizer, sd: dict) -> None: ...


@runtime_checkable
class OuterSync(Protocol):
    """What runs after each optimizer step outside the gradient sync: DiLoCo's outer step
    (``ndtrain.parallel.dp.diloco``) or nothing (``NoOuterSync``)."""

    def step_loss(self, loss: float) -> float:
        """The loss a step reports from this rank's loss-group mean (DiLoCo: the replicas' mean)."""

    def after_step(self, applied: bool) -> dict:
        """After the optimizer step; ``applied`` False for a skipped step (bad step, fp16
        overflow), which must change nothing. Returns the step's metrics (``outer_step``)."""

    def weights_loaded(self) -> None:
        """The model's weights were replaced (a fine-tune's start): restart from them."""

    def pack(self, state: dict, whole: Callable[[dict], dict]) -> dict:
        """The checkpoint tree from the adapter's ``{"model", "optim"}``; ``whole(local)`` turns
        ``{name: local tensor shaped like that parameter}`` into whole tensors under global names."""

    def unpack(self, state: dict, local: Callable[[dict], dict]) -> dict:
        """Inverse of ``pack`` on a loaded tree: restores the outer state (``local`` is ``whole``'s
        inverse) and returns the ``{"model", "optim"}`` the adapter loads into the model."""


class NoOuterSync:
    """No outer loop: every method is the identity or does nothing."""

    def step_loss(self, loss: float) -> float:
        return loss

    def after_step(self, applied: bool) -> dict:
        return {}

    def weights_loaded(self) -> None:
        pass

    def pack(self, state: dict, whole) -> dict:
        return state

    def unpack(self, state: dict, local) -> dict:
        return state


@dataclass
class ParallelPlan:
    """Everything layout-dependent the trainer needs, built once by ``parallelize`` (the trainer
    never asks which axes are on).

    Fields:
        model: this rank's model, or its pipeline stage, parallelized in place.
        grad_sync: its ``GradSync`` (DDP, ZeRO-1/2, ZeRO-3 / FSDP / HSDP or expert data parallel).
        batch: ``shard(inputs, labels)`` and ``loss_sum(logits, labels)`` (``ndtrain.parallel.batch``).
        state: the checkpoint adapter (``ndtrain.parallel.state.CheckpointAdapter``): whole tensors
            under global names, whatever the aliasing and layout (the outer state included).
        pipeline: ``StagePipeline`` running the microbatches of a step; with pp == 1 the whole
            model is its one stage (forward then backward per microbatch), so training has one path.
        sample_skip_reason: "" when rank 0 can generate alone after training, else why not.
        outer: the ``OuterSync`` (DiLoCo under ``training.local_sgd_steps``).
        loss_group: the mesh group whose valid labels normalise one loss ("dp_cp"; one replica's
            "dp_shard_cp" under DiLoCo, where each replica trains on its own).
        agree_overlaps_forward: the batch agreement's all-reduce may run during the first forward
            (a forward with no data-parallel collective to desynchronise: plain DDP, one stage, no
            MoE / MTP, no DiLoCo).
        micro_batch: rows per microbatch of a one-stage step; fixed_microbatches: a pipeline's
            microbatch count (0: one stage, counted from ``micro_batch``).
        eval_loss_sum: ``(inputs, labels, positions, documents=None) -> summed token loss`` of a forward-only pass
            (the whole local batch at once on one stage; the pipeline's microbatches across stages).
    """

    model: nn.Module
    grad_sync: GradSync
    batch: Any
    state: Any
    pipeline: Any = None
    sample_skip_reason: str = ""
    outer: OuterSync = field(default_factory=NoOuterSync)
    loss_group: str = "dp_cp"
    agree_overlaps_forward: bool = False
    micro_batch: int = 1
    fixed_microbatches: int = 0
    eval_loss_sum: Callable | None = None

    @property
    def can_sample(self) -> bool:
        return not self.sample_skip_reason

    def shard(self, inputs: torch.Tensor, labels: torch.Tensor, documents: torch.Tensor | None = None):
        """This rank's (inputs, labels, positions, documents) of a (B, T) batch (``BatchPlan.shard``)."""
        return self.batch.shard(inputs, labels, documents)

    def loss_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.batch.loss_sum(logits, labels)

    def microbatches(self, local_rows: int) -> int:
        """Microbatches of a step over ``local_rows`` sequences: the pipeline's fixed count, or on
        one stage ceil(local_rows / micro_batch) (the last may be short)."""
        return self.fixed_microbatches or -(-local_rows // self.micro_batch)
