"""Per-batch hooks of a layout (cp's batch cut, tp's vocab-parallel loss, the fused loss), built by
``parallelize``."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ndtrain.mesh import Mesh
from ndtrain.mixer_spec import non_softmax_mixers
from ndtrain.model.documents import document_positions
from ndtrain.parallel import comm
from ndtrain.parallel.cp.rules import resolve_layout


class BatchPlan:
    """Per-batch hooks of the layout, used by the trainer.

    ``shard(inputs, labels, documents=None)``: (B, T) -> this rank's (B, T_local) inputs, labels,
    (T_local,) positions (None: ``arange(T)``) and documents (None); labels are shifted before the cut.
    With (B, T) ``documents`` (packed ids) positions restart per document, (B, T_local), and the
    documents are cut like the tokens (int64). ``loss_sum(logits, labels)``:
    0-d sum of valid token losses, logits (B, T, V) or (B, T, Vp / tp) (never gathered).
    ``fused_impl``: "chunk" | "triton". ``head``: the ``FusedLossHead`` under ``training.fused_loss``."""

    def __init__(self, mesh: Mesh, cfg, ignore_index: int = -100, fused_impl: str = "chunk"):
        p = cfg.parallel
        self.cp, self.tp = mesh.group("cp"), mesh.group("tp")
        self.layout = resolve_layout(p.cp_impl, p.cp_layout, non_softmax_mixers(cfg.model))
        self.full_positions = p.sequence_parallel
        self.cp_balance = None  # packed documents dealt to cp ranks by attention work (cp.doc_balance)
        if getattr(p, "cp_doc_balance", False) and self.cp.size > 1:
            from ndtrain.parallel.cp.doc_balance import WorkBalance

            self.cp_balance = WorkBalance(self.cp.size)
        self.vocab_size, self.ignore_index = cfg.model.vocab_size, ignore_index
        if fused_impl not in ("chunk", "triton"):
            raise ValueError(f"fused_impl ({fused_impl!r}) must be chunk|triton")
        self.fused_impl = fused_impl
        self.head = None

    def shard(self, inputs: torch.Tensor, labels: torch.Tensor, documents: torch.Tensor | None = None):
        if documents is not None:
            documents = documents.to(device=inputs.device, dtype=torch.int64)
        if self.cp.size > 1:
            from ndtrain.parallel.cp.context_parallel import shard_batch

            if self.cp_balance is not None and documents is None:
                self.cp_balance.current = None  # the cores fall back to the mirror layout too
            return shard_batch(inputs, labels, self.cp, self.layout, documents, self.cp_balance)
        if documents is not None:
            return inputs, labels, document_positions(documents), documents
        positions = torch.arange(inputs.shape[1], device=inputs.device) if self.full_positions else None
        return inputs, labels, positions, None

    def loss_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.tp.size > 1:
            from ndtrain.parallel.tp.vocab_loss import vocab_parallel_cross_entropy

            return vocab_parallel_cross_entropy(logits.flatten(0, 1), labels.flatten(), self.tp,
                                                self.vocab_size, self.ignore_index).sum()
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=self.ignore_index,
                               reduction="sum")

    def labelled(self, labels: torch.Tensor):
        """Context arming the fused-loss head (if any) with a microbatch's (B, T) labels."""
        from ndtrain.parallel.fused_head import head_labels

        return head_labels(self.head, labels)

    def stage_loss(self, out: torch.Tensor, labels: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The last stage's summed token loss: the armed head's 0-d sum, or ``loss_sum`` of logits
        (B, T, V | Vp / tp) cast to ``dtype``."""
        if self.head is not None and out.dim() == 0:
            return out.to(dtype)
        return self.loss_sum(out.to(dtype), labels)

    def fused_loss_sum(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                       region_entered: bool = False) -> torch.Tensor:
        """``loss_sum`` of ``hidden @ weight^T`` without the logits (``ops.linear_cross_entropy``: chunked
        PyTorch, or Triton with ``fused_impl="triton"``); returns the 0-d sum over valid labels.

        hidden (B, T, C) (gathered under sp); weight (V, C), or (Vp / tp, C) under tp, where the partial
        max / sum-exp / target logit meet in two all-reduces (MAX, then SUM of 2N values) and hidden's
        gradient is summed over tp (Megatron's f, unless ``region_entered``)."""
        if self.fused_impl == "triton":
            from ndtrain.ops.linear_cross_entropy.triton import fused_linear_cross_entropy as fused
        else:
            from ndtrain.ops.linear_cross_entropy.chunk import chunk_linear_cross_entropy as fused

        h, y = hidden.flatten(0, 1), labels.flatten()  # (B*T, C), (B*T,)
        if self.tp.size == 1:
            return fused(h, weight, y, self.ignore_index, vocab_size=self.vocab_size).sum()
        from ndtrain.parallel.tp.collectives import CopyToTP

        tp = self.tp
        if not region_entered:
            h = CopyToTP.apply(h, tp)

        def combine(m, s, t):  # this rank's (N,) partials -> the tp-wide statistics
            m_all = m.clone()
            comm.all_reduce(m_all, tp, op=dist.ReduceOp.MAX)
            st = torch.stack([s * torch.exp(m - m_all), t])  # (2, N)
            comm.all_reduce(st, tp)
            return m_all, st[0], st[1]

        return fused(h, weight, y, self.ignore_index, tp.rank * weight.shape[0], combine,
                     vocab_size=self.vocab_size).sum()
