"""``training.fused_loss``: the output head computes the loss itself, never the (B, T, V) logits.

``apply_fused_loss`` replaces ``model.output`` (``nn.Linear`` or tp's vocab-parallel head) with a
``FusedLossHead`` owning the same ``weight`` under the same name (state dicts, ties, checkpoints,
HF export, ZeRO-3 units unchanged). Armed with a microbatch's labels (``head_labels``: the last pp
stage, the eval forward) it returns ``BatchPlan.fused_loss_sum`` (fused linear + cross-entropy,
Wijmans et al. 2024); unarmed (generation, MTP) it returns logits. The loss runs inside the head's
forward so ZeRO-3's hooks have the weight gathered exactly then."""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn


class FusedLossHead(nn.Module):
    """Output projection (V, C), or (Vp / tp, C) rows, with the loss fused in: h (B, T, C) (sp:
    (B, T / tp, C), gathered first) -> logits (B, T, V | Vp / tp) unarmed, a 0-d loss sum armed.
    ``loss``: ``(h, weight, labels, region_entered) -> 0-d``; ``tp``: the AxisGroup if vocab-parallel."""

    def __init__(self, weight: nn.Parameter, loss, tp=None, sp: bool = False):
        super().__init__()
        self.weight = weight
        self.loss, self.tp, self.sp = loss, tp, sp
        self.labels: torch.Tensor | None = None  # (B, T) while armed

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.tp is not None:  # Megatron's f: replicate (or gather along T) the head's input
            from ndtrain.parallel.tp.collectives import CopyToTP, GatherFromSequence
            from ndtrain.parallel.tp.layers import SEQ_DIM

            h = GatherFromSequence.apply(h, self.tp, SEQ_DIM) if self.sp else CopyToTP.apply(h, self.tp)
        if self.labels is None:
            return F.linear(h, self.weight)
        if h.shape[:-1] != self.labels.shape:  # e.g. an MTP depth's shorter sequence (rejected by validate)
            raise ValueError(f"fused loss head armed with labels {tuple(self.labels.shape)} got hidden "
                             f"states {tuple(h.shape)}")
        return self.loss(h, self.weight, self.labels, region_entered=self.tp is not None)

    def extra_repr(self) -> str:
        tp = f", vocab-parallel tp={self.tp.size}, sp={self.sp}" if self.tp is not None else ""
        return f"in={self.weight.shape[1]}, out={self.weight.shape[0]}, fused cross-entropy{tp}"


def apply_fused_loss(model: nn.Module, batch) -> FusedLossHead | None:
    """Install a ``FusedLossHead`` computing ``batch.fused_loss_sum``; returns it (None on a stage without
    the head). Call after tp and before dp. Raises TypeError for a head that is neither a bias-free
    ``nn.Linear`` nor vocab-parallel."""
    old = getattr(model, "output", None)
    if old is None:
        return None
    from ndtrain.parallel.tp.layers import ColumnParallelLinear

    if isinstance(old, ColumnParallelLinear):
        head = FusedLossHead(old.weight, batch.fused_loss_sum, old.group if old.enter_region else None, old.sp)
    elif isinstance(old, nn.Linear) and old.bias is None:
        head = FusedLossHead(old.weight, batch.fused_loss_sum)
    else:
        raise TypeError(f"training.fused_loss: cannot fuse the loss into a {type(old).__name__} head")
    model.output = head
    return head


@contextlib.contextmanager
def head_labels(head: FusedLossHead | None, labels: torch.Tensor):
    """Arm ``head`` with a microbatch's (B, T) labels for the forwards inside; no-op for None."""
    if head is None:
        yield
        return
    head.labels = labels
    try:
        yield
    finally:
        head.labels = None
