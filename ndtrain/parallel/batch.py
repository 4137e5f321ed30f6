"""The per-batch hooks of a layout: cutting a rank's batch (context parallel) and the loss
(tensor parallel: vocab-parallel cross-entropy; ``fused_loss_sum``: fused with the output head).
Built by ``ndtrain.parallel.parallelize``."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ndtrain.mesh import Mesh
from ndtrain.parallel import comm
from ndtrain.parallel.cp.rules import resolve_layout


class BatchPlan:
    """Per-batch hooks of the layout, used by the trainer.

    ``shard(inputs, labels)``: (B, T) -> this rank's (B, T_local) inputs, labels and (T_local,)
    RoPE positions (None when the model's default ``arange(T)`` is right). Labels are already
    shifted, so cutting after the shift keeps every (input, label) pair together.
    ``loss_sum(logits, labels)``: sum of token cross-entropies over valid labels (0-d tensor);
    logits (B, T, V), or (B, T, Vp / tp) under tensor parallel (vocab-parallel, never gathered).
    """

    def __init__(self, mesh: Mesh, cfg, ignore_index: int = -100):
        p = cfg.parallel
        self.cp, self.tp = mesh.group("cp"), mesh.group("tp")
        self.layout = resolve_layout(p.cp_impl, p.cp_layout)
        self.full_positions = p.sequence_parallel
        self.vocab_size, self.ignore_index = cfg.model.vocab_size, ignore_index

    def shard(self, inputs: torch.Tensor, labels: torch.Tensor):
        if self.cp.size > 1:
            from ndtrain.parallel.cp.context_parallel import shard_batch

            return shard_batch(inputs, labels, self.cp, self.layout)
        positions = torch.arange(inputs.shape[1], device=inputs.device) if self.full_positions else None
        return inputs, labels, positions

    def loss_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.tp.size > 1:
            from ndtrain.parallel.tp.vocab_loss import vocab_parallel_cross_entropy

            return vocab_parallel_cross_entropy(logits.flatten(0, 1), labels.flatten(), self.tp,
                                                self.vocab_size, self.ignore_index).sum()
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=self.ignore_index,
                               reduction="sum")

    def fused_loss_sum(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """``loss_sum`` of the logits ``hidden @ weight^T`` without materialising them (fused linear +
        cross-entropy, ``ndtrain.ops.linear_cross_entropy``; needs Triton).

        hidden (B, T, C): the output head's whole input (under sequence parallel: already gathered);
        weight (V, C), or this rank's (Vp / tp, C) rows under tensor parallel, where each rank's
        partial max / sum-exp / target logit meet in two all-reduces over ``tp`` (MAX, then SUM of
        2N values, as ``vocab_parallel_cross_entropy``) and hidden's gradient is summed over ``tp``
        (Megatron's f operator). Returns the 0-d sum over valid labels.
        """
        from ndtrain.ops.linear_cross_entropy.triton import fused_linear_cross_entropy

        h, y = hidden.flatten(0, 1), labels.flatten()  # (B*T, C), (B*T,)
        if self.tp.size == 1:
            return fused_linear_cross_entropy(h, weight, y, self.ignore_index, vocab_size=self.vocab_size).sum()
        from ndtrain.parallel.tp.collectives import CopyToTP

        tp = self.tp

        def combine(m, s, t):  # this rank's (N,) partials -> the tp-wide statistics
            m_all = m.clone()
            comm.all_reduce(m_all, tp, op=dist.ReduceOp.MAX)
            st = torch.stack([s * torch.exp(m - m_all), t])  # (2, N)
            comm.all_reduce(st, tp)
            return m_all, st[0], st[1]

        return fused_linear_cross_entropy(CopyToTP.apply(h, tp), weight, y, self.ignore_index,
                                          tp.rank * weight.shape[0], combine, vocab_size=self.vocab_size).sum()
