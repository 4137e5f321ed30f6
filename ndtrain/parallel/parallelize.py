"""The one place that applies parallelism to a single-device model, in a fixed order.

Order (each step sees the result of the previous ones):
  1. pipeline split                       (parallel.pp; ndtrain.parallel.pp.stage: layers per stage,
                                           parameters tagged "pp" after TP / EP re-create them)
  2. tensor + sequence parallel           (parallel.tp, parallel.sequence_parallel)
  3. expert parallel                      (parallel.ep; MoE models: experts sharded over ep)
  4. context parallel                     (parallel.cp, cp_impl, cp_layout)
  5. activation checkpointing             (training.activation_checkpoint)
  6. data parallel: DDP / ZeRO / FSDP     (parallel.zero_stage, dp_replicate x dp_shard)
Data parallel comes last because it must see the final set of (possibly sharded) parameters.

``build_batch_plan`` gives the trainer the two per-batch hooks the axes need: cutting a rank's
batch (context parallel: tokens, labels and RoPE positions by the cp layout) and the loss
(tensor parallel: vocab-parallel cross-entropy over vocabulary-split logits).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ndtrain.config import Config
from ndtrain.mesh import Mesh
from ndtrain.parallel.dp.ddp import DataParallel


def apply_data_parallel(model: nn.Module, mesh: Mesh, cfg: Config) -> DataParallel:
    """Wrap ``model``'s gradient synchronisation: plain DDP over ``dp`` (zero_stage 0), ZeRO-1/2
    (``ndtrain.parallel.zero.zero12``) or ZeRO-3 / HSDP (``ndtrain.parallel.zero.fsdp``) over ``dp_shard_cp``
    (x ``dp_replicate``). All return an object with the ``DataParallel`` interface."""
    p = cfg.parallel
    if p.zero_stage != 0:
        from ndtrain.precision import compute_dtype, grad_reduce_dtype

        cd = compute_dtype(cfg.training.dtype)
        rd = grad_reduce_dtype(cfg.training.dtype, p.grad_reduce_dtype)
        if p.zero_stage in (1, 2):
            from ndtrain.parallel.zero.zero12 import ZeroDataParallel

            return ZeroDataParallel(model, mesh, p.zero_stage, p.bucket_size_bytes, cd, rd)
        from ndtrain.parallel.zero.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(model, mesh, reshard_after_forward=p.reshard_after_forward,
                                        keep_last_unit=p.keep_last_unit_gathered,
                                        compute_dtype=cd, reduce_dtype=rd)
    reduce_dtype = None
    if cfg.training.dtype == "bfloat16":
        reduce_dtype = getattr(torch, p.grad_reduce_dtype)
    # cp ranks see different tokens of the same samples: their gradients are summed too.
    group = mesh.group("dp_cp" if mesh.dims.cp > 1 else "dp")
    return DataParallel(model, group, p.bucket_size_bytes, reduce_dtype)


def parallelize(model: nn.Module, mesh: Mesh, cfg: Config) -> DataParallel:
    """Apply every configured axis to ``model`` (in place) and return its gradient synchroniser."""
    p = cfg.parallel
    if mesh.dims.pp > 1:  # no-op for a stage built by pp.build_pipeline_stage
        from ndtrain.parallel.pp.stage import apply_pipeline

        apply_pipeline(model, mesh, cfg)
    if mesh.dims.tp > 1:
        from ndtrain.parallel.tp.tensor_parallel import apply_tp

        apply_tp(model, mesh, p.sequence_parallel)
    expert_names: list[str] = []
    if cfg.model.is_moe:
        from ndtrain.parallel.ep.expert_parallel import apply_ep

        expert_names = apply_ep(model, mesh, cfg)
    if mesh.dims.cp > 1:
        from ndtrain.parallel.cp.context_parallel import apply_cp

        apply_cp(model, mesh, p.cp_impl, p.cp_layout)
    if cfg.training.activation_checkpoint != "none":
        from ndtrain.parallel.activation_ckpt import apply_activation_checkpoint

        apply_activation_checkpoint(model, cfg.training.activation_checkpoint)
    if mesh.dims.pp > 1:  # stages hold disjoint parameters: grad-norm squares sum over pp
        from ndtrain.parallel.pp.stage import tag_pipeline_params

        tag_pipeline_params(model)
    if expert_names:  # expert weights reduce over edp, the rest over dp (ndtrain.parallel.ep.expert_parallel)
        from ndtrain.parallel.ep.expert_parallel import ExpertDataParallel

        reduce_dtype = getattr(torch, p.grad_reduce_dtype) if cfg.training.dtype == "bfloat16" else None
        return ExpertDataParallel(model, mesh, cfg, expert_names, reduce_dtype)
    return apply_data_parallel(model, mesh, cfg)


class BatchPlan:
    """Per-batch hooks of the layout, used by the trainer.

    ``shard(inputs, labels)``: (B, T) -> this rank's (B, T_local) inputs, labels and (T_local,)
    RoPE positions (None when the model's default ``arange(T)`` is right). Labels are already
    shifted, so cutting after the shift keeps every (input, label) pair together.
    ``loss_sum(logits, labels)``: sum of token cross-entropies over valid labels; logits (B, T, V),
    or (B, T, Vp / tp) under tensor parallel (vocab-parallel, never gathered).
    """

    def __init__(self, mesh: Mesh, cfg: Config, ignore_index: int = -100):
        from ndtrain.parallel.cp.context_parallel import resolve_layout

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


def build_batch_plan(mesh: Mesh, cfg: Config) -> BatchPlan:
    """The batch-cutting and loss hooks of ``cfg``'s layout (see ``BatchPlan``)."""
    return BatchPlan(mesh, cfg)
