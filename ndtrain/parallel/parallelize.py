"""The one place that applies parallelism to a single-device model, in a fixed order.

Order (each step sees the result of the previous ones):
  1. pipeline split                       (parallel.pp; not implemented yet)
  2. tensor + sequence parallel           (parallel.tp, parallel.sequence_parallel; not yet)
  3. expert parallel                      (parallel.ep; MoE models: experts sharded over ep)
  4. context parallel                     (parallel.cp; not yet)
  5. activation checkpointing             (training.activation_checkpoint)
  6. data parallel: DDP / ZeRO / FSDP     (parallel.zero_stage, dp_replicate x dp_shard)
Data parallel comes last because it must see the final set of (possibly sharded) parameters.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ndtrain.config import Config
from ndtrain.mesh import Mesh
from ndtrain.parallel.ddp import DataParallel


def apply_data_parallel(model: nn.Module, mesh: Mesh, cfg: Config) -> DataParallel:
    """Wrap ``model``'s gradient synchronisation: plain DDP over ``dp`` (zero_stage 0), ZeRO-1/2
    (``ndtrain.parallel.zero``) or ZeRO-3 / HSDP (``ndtrain.parallel.fsdp``) over ``dp_shard_cp``
    (x ``dp_replicate``). All return an object with the ``DataParallel`` interface."""
    p = cfg.parallel
    if p.zero_stage != 0:
        from ndtrain.precision import compute_dtype, grad_reduce_dtype

        cd = compute_dtype(cfg.training.dtype)
        rd = grad_reduce_dtype(cfg.training.dtype, p.grad_reduce_dtype)
        if p.zero_stage in (1, 2):
            from ndtrain.parallel.zero import ZeroDataParallel

            return ZeroDataParallel(model, mesh, p.zero_stage, p.bucket_size_bytes, cd, rd)
        from ndtrain.parallel.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(model, mesh, reshard_after_forward=p.reshard_after_forward,
                                        keep_last_unit=p.keep_last_unit_gathered,
                                        compute_dtype=cd, reduce_dtype=rd)
    reduce_dtype = None
    if cfg.training.dtype == "bfloat16":
        reduce_dtype = getattr(torch, p.grad_reduce_dtype)
    return DataParallel(model, mesh.group("dp"), p.bucket_size_bytes, reduce_dtype)


def parallelize(model: nn.Module, mesh: Mesh, cfg: Config) -> DataParallel:
    """Apply every configured axis to ``model`` (in place) and return its gradient synchroniser."""
    p = cfg.parallel
    expert_names: list[str] = []
    if cfg.model.is_moe:
        from ndtrain.parallel.ep import apply_ep

        expert_names = apply_ep(model, mesh, cfg)
    if cfg.training.activation_checkpoint != "none":
        from ndtrain.parallel.activation_ckpt import apply_activation_checkpoint

        apply_activation_checkpoint(model, cfg.training.activation_checkpoint)
    if expert_names:  # expert weights reduce over edp, the rest over dp (ndtrain.parallel.ep)
        from ndtrain.parallel.ep import ExpertDataParallel

        reduce_dtype = getattr(torch, p.grad_reduce_dtype) if cfg.training.dtype == "bfloat16" else None
        return ExpertDataParallel(model, mesh, cfg, expert_names, reduce_dtype)
    return apply_data_parallel(model, mesh, cfg)
