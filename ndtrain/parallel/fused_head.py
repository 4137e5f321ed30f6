"""``training.fused_loss``: the output head computes the loss itself, never the (B, T, V) logits.

``apply_fused_loss(model, batch)`` replaces ``model.output`` (an ``nn.Linear``, or tensor parallel's
vocab-parallel ``ColumnParallelLinear``) with a ``FusedLossHead`` that owns the same ``weight``
Parameter under the same name, so state dicts, tied embeddings, checkpoints, Hugging Face export and
the ZeRO-3 unit of the head are unchanged. Whoever knows a microbatch's labels arms the head
(``head_labels``) around the forward: the pipeline's last stage (``pp.pipeline``) and the trainer's
eval forward. Armed, the head returns ``BatchPlan.fused_loss_sum(h, weight, labels)`` (a 0-d sum of
token losses; Wijmans et al. 2024's fused linear + cross-entropy, chunked over tokens and vocabulary)
and the stage loss passes it through; unarmed (generation, MTP heads) it returns logits as before.

Computing the loss *inside* the head's forward matters for ZeRO-3: the head unit's weights are
gathered by hooks around that forward (and around its backward), so the fused loss sees them
gathered exactly when the logits matmul would have.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn


class FusedLossHead(nn.Module):
    """The output projection (V, C), or this rank's (Vp / tp, C) rows, with the loss fused in.

    Args:
        weight: the replaced head's Parameter (kept as is: tied or tp-split).
        loss: ``(h (B, T, C), weight, labels (B, T), region_entered) -> 0-d sum of token losses``
            (``BatchPlan.fused_loss_sum``).
        tp: tensor parallel's AxisGroup when the head is vocab-parallel, else None; sp: sequence
            parallel (the input arrives split along T and is gathered first).
    Shapes: h (B, T, C) (under SP (B, T / tp, C)) -> logits (B, T, V | Vp / tp) unarmed, 0-d armed.
    """

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
    """Replace ``model.output`` by a ``FusedLossHead`` computing ``batch.fused_loss_sum``; returns
    it (None for a pipeline stage without the head). Call after tensor parallel (which installs
    the vocab-parallel head) and before data parallel (ZeRO-3 builds its units from the modules).
    Raises TypeError for a head that is neither ``nn.Linear`` without bias nor vocab-parallel."""
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
