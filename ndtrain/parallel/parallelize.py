"""The one place that applies parallelism to a single-device model, in a fixed order.

Order (each step sees the result of the previous ones):
  1. pipeline split                       (parallel.pp; ndtrain.parallel.pp.stage: layers per stage,
                                           parameters tagged "pp" after TP / EP re-create them)
  2. expert parallel                      (parallel.ep; MoE models: experts sharded over ep; on a
                                           folded expert mesh also split over parallel.expert_tp)
  3. tensor + sequence parallel           (parallel.tp, parallel.sequence_parallel, expert_tp)
  4. context parallel                     (parallel.cp, cp_impl, cp_layout)
     LoRA adapters                        (finetune.lora_rank; parallel.lora: split like their base
                                           linear, the rest frozen; base matrices lowered to the
                                           autocast dtype after step 8)
  5. fused loss head                      (training.fused_loss; parallel.fused_head: after tp's
                                           vocab-parallel head, before ZeRO-3 builds its units)
  6. activation checkpointing             (training.activation_checkpoint)
  7. float8 linears, torch.compile         (training.fp8, training.compile; parallel.compile: after
                                           checkpointing, whose hooks stay outside the compiled code)
  8. data parallel: DDP / ZeRO / FSDP     (parallel.zero_stage, dp_replicate x dp_shard)
Data parallel comes last because it must see the final set of (possibly sharded) parameters.
Then, from the result, everything else that depends on the layout: the batch plan (cp cut,
vocab-parallel loss), the checkpoint adapter (tp gather / scatter, tied-head names), the pipeline
runner (pp > 1), the outer loop (DiLoCo, ``training.local_sgd_steps``), how a step is cut into
microbatches and evaluated, and whether rank 0 may generate alone. ``parallelize`` returns them as one
``ParallelPlan`` (``ndtrain.parallel.api``): the trainer uses nothing else.
"""
from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING

import torch
from torch import nn

from ndtrain.mesh import Mesh
from ndtrain.model import build_model
from ndtrain.model.kernels import apply_kernels, resolve_kernels
from ndtrain.parallel.api import GradSync, NoOuterSync, ParallelPlan
from ndtrain.parallel.batch import BatchPlan
from ndtrain.parallel.dp.ddp import DataParallel
from ndtrain.parallel.dp.diloco import DiLoCo
from ndtrain.parallel.state import CheckpointAdapter
from ndtrain.precision import compute_dtype, grad_reduce_dtype

if TYPE_CHECKING:  # annotations only: the config package validates with parallel's rules
    from ndtrain.config import Config


def apply_data_parallel(model: nn.Module, mesh: Mesh, cfg: Config, expert_names: list[str] = ()) -> DataParallel:
    """Wrap ``model``'s gradient synchronisation: plain DDP over ``dp`` (zero_stage 0), ZeRO-1/2
    (``ndtrain.parallel.zero.zero12``) or ZeRO-3 / HSDP (``ndtrain.parallel.zero.fsdp``) over ``dp_shard_cp``
    (x ``dp_replicate``), the ``expert_names`` parameters (expert parallel) over ``edp_shard``
    (x ``dp_replicate``). All return an object with the ``DataParallel`` interface."""
    p = cfg.parallel
    if p.zero_stage != 0:
        cd = compute_dtype(cfg.training.dtype)
        rd = grad_reduce_dtype(cfg.training.dtype, p.grad_reduce_dtype)
        if p.zero_stage in (1, 2):
            from ndtrain.parallel.zero.zero12 import ZeroDataParallel

            return ZeroDataParallel(model, mesh, p.zero_stage, p.bucket_size_bytes, cd, rd, expert_names)
        from ndtrain.parallel.zero.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(model, mesh, reshard_after_forward=p.reshard_after_forward,
                                        keep_last_unit=p.keep_last_unit_gathered,
                                        compute_dtype=cd, reduce_dtype=rd, expert_names=expert_names)
    reduce_dtype = None
    if cfg.training.dtype in ("bfloat16", "float16"):  # fp16 too: parallel.grad_reduce_dtype is honoured
        reduce_dtype = getattr(torch, p.grad_reduce_dtype)
    # cp ranks see different tokens of the same samples: their gradients are summed too.
    group = mesh.group("dp_cp" if mesh.dims.cp > 1 else "dp")
    if cfg.training.local_sgd_steps:  # DiLoCo: replicas sync only every H steps (parallel.dp.diloco)
        group = mesh.group("dp_shard_cp" if mesh.dims.cp > 1 else "dp_shard")
    return DataParallel(model, group, p.bucket_size_bytes, reduce_dtype)


def param_dtype(cfg: Config) -> torch.dtype:
    """Dtype of the parameters (and master weights): float64 for float64 runs, else float32."""
    return torch.float64 if cfg.training.dtype == "float64" else torch.float32


def parallelize(model: nn.Module | None, mesh: Mesh, cfg: Config,
                device: torch.device | None = None) -> ParallelPlan:
    """Apply every configured axis to ``model`` (in place) and build the rest of the layout.

    Args:
        model: a materialised single-device model, or None to build it here on ``device`` in
            ``param_dtype(cfg)`` with ``training.seed`` -- under pp only this rank's stage, on
            meta first (``ndtrain.parallel.pp.stage.build_pipeline_stage``), so no rank ever
            holds the whole model.
        mesh: the layout; cfg: the validated config; device: this rank's device (default CPU).
    Returns the ``ParallelPlan`` the trainer uses (model, grad_sync, batch, state, pipeline).
    """
    device = device or torch.device("cpu")
    if model is None:
        model = _build(cfg, mesh, device)
    first = next(model.parameters(), None)  # auto follows the model's device
    kernels = resolve_kernels(cfg.training.kernels, cuda=first is not None and first.is_cuda)
    apply_kernels(model, kernels)  # before cp, whose ring / Ulysses core replaces the kernel
    batch = BatchPlan(mesh, cfg, fused_impl="triton" if kernels == "triton" else "chunk")
    grad_sync = _apply_axes(model, mesh, cfg, batch)
    if cfg.finetune.lora_rank:  # after data parallel, which holds the trainable parameters in one dtype
        from ndtrain.parallel.lora import lower_frozen

        lower_frozen(model, compute_dtype(cfg.training.dtype))
    pipeline = _build_pipeline(model, grad_sync, batch, mesh, cfg, device)  # pp == 1: one stage
    return _plan(model, grad_sync, batch, pipeline, mesh, cfg, device)


def _plan(model: nn.Module, grad_sync: GradSync, batch: BatchPlan, pipeline, mesh: Mesh, cfg: Config,
          device: torch.device) -> ParallelPlan:
    """The ``ParallelPlan`` around the parallelized ``model``: what differs between layouts for
    the trainer (the outer loop, loss group, microbatching, evaluation, clipping's tied copy)."""
    from ndtrain.parallel.pp.pipeline import uncounted_tied_copy

    t, d = cfg.training, mesh.dims
    grad_sync.norm_uncounted = uncounted_tied_copy(model, grad_sync)
    outer = NoOuterSync()
    if t.local_sgd_steps:  # DiLoCo: each replica trains alone between outer steps (its own loss group)
        outer = DiLoCo(model, mesh, t.local_sgd_steps, t.outer_lr, t.outer_momentum)
    local = t.global_batch_size // d.dp
    extras = cfg.model.is_moe or cfg.model.mtp_depth > 0
    plain_ddp = cfg.parallel.zero_stage == 0 and not cfg.model.is_moe  # DataParallel, no expert sync
    return ParallelPlan(
        model, grad_sync, batch, CheckpointAdapter(model, grad_sync, mesh, outer), pipeline,
        sample_skip_reason(mesh, cfg), outer=outer,
        loss_group="dp_shard_cp" if t.local_sgd_steps else "dp_cp",
        agree_overlaps_forward=plain_ddp and d.pp == 1 and not extras and not t.local_sgd_steps,
        micro_batch=t.micro_batch_size or local,
        fixed_microbatches=pipeline.m if d.pp > 1 else 0,
        eval_loss_sum=(pipeline.eval_loss_sum if d.pp > 1
                       else functools.partial(_whole_batch_loss_sum, model, batch, _forward_ctx(cfg, device),
                                              param_dtype(cfg))))


def _whole_batch_loss_sum(model: nn.Module, batch: BatchPlan, forward_ctx, dtype: torch.dtype,
                          inputs: torch.Tensor, labels: torch.Tensor,
                          positions: torch.Tensor | None = None, documents: torch.Tensor | None = None) -> torch.Tensor:
    """Summed token cross-entropy (float64, 0-d) of one forward over the whole local batch (one
    stage). inputs, labels: (B, T); positions (T,). Under ``training.fused_loss`` the armed head
    returns that sum itself (no logits)."""
    with forward_ctx(), batch.labelled(labels):
        out = (model(inputs, positions) if documents is None  # (B, T, V), (B, T, V / tp), or the fused 0-d sum
               else model(inputs, positions, documents=documents))
    return batch.stage_loss(out, labels, dtype).double()


def _build(cfg: Config, mesh: Mesh, device: torch.device) -> nn.Module:
    from ndtrain.optim.mup import hidden_init_factor

    factor = hidden_init_factor(cfg.model.dim, cfg.training.mup_base_width)
    if mesh.dims.pp > 1:  # only this rank's stage
        from ndtrain.parallel.pp.stage import build_pipeline_stage

        return build_pipeline_stage(cfg, mesh, device, param_dtype(cfg), cfg.training.seed, factor)
    return build_model(cfg.model, device, param_dtype(cfg), cfg.training.seed, factor)


def _build_pipeline(model: nn.Module, grad_sync: GradSync, batch: BatchPlan, mesh: Mesh, cfg: Config,
                    device: torch.device):
    """The stage's ``StagePipeline``: the layout's loss on logits cast to the parameter dtype,
    autocast from ``training.dtype``, ``pp_microbatches`` (default: local batch / micro batch)."""
    from ndtrain.parallel.pp.pipeline import StagePipeline

    t, dtype = cfg.training, param_dtype(cfg)
    local = t.global_batch_size // mesh.dims.dp
    n_micro = cfg.parallel.pp_microbatches or local // (t.micro_batch_size or local)
    return StagePipeline(
        model, grad_sync, mesh, cfg, lambda out, y: batch.stage_loss(out, y, dtype), _forward_ctx(cfg, device),
        device, n_micro, labelled=batch.labelled if batch.head is not None else None)


def _forward_ctx(cfg: Config, device: torch.device):
    """Factory of the context forwards run in: autocast to ``training.dtype`` (bf16 / fp16), else none."""
    ac = compute_dtype(cfg.training.dtype)
    return lambda: torch.autocast(device.type, dtype=ac) if ac is not None else contextlib.nullcontext()


def sample_skip_reason(mesh: Mesh, cfg: Config) -> str:
    """"" if rank 0 can run ``ndtrain.inference.generate`` alone on its model, else why not: a forward that
    needs other ranks (split heads / vocabulary, cut sequences, other stages, experts elsewhere or split,
    ZeRO-3 parameters gathered by collectives)."""
    d = mesh.dims
    split = [a for a in ("tp", "cp", "pp", "ep") if getattr(d, a) > 1]
    if getattr(d, "expert_tp", 1) > 1 and d.tp == 1:  # a folded expert mesh splits experts under tp 1
        split.append("expert_tp")
    if cfg.parallel.zero_stage == 3 and d.dp_shard * d.cp > 1:
        split.append("sharded ZeRO-3")
    return f"this layout splits the forward over ranks ({' / '.join(split)})" if split else ""


def _apply_axes(model: nn.Module, mesh: Mesh, cfg: Config, batch: BatchPlan) -> GradSync:
    """Steps 1-8 of the module docstring, in order, in place; returns the gradient synchroniser.
    Sets ``batch.head`` under ``training.fused_loss``."""
    p = cfg.parallel
    if mesh.dims.pp > 1:  # prunes a full model; a no-op for a stage built by _build
        from ndtrain.parallel.pp.stage import apply_pipeline

        apply_pipeline(model, mesh, cfg)
    expert_names: list[str] = []
    if cfg.model.is_moe:
        from ndtrain.parallel.ep.expert_parallel import apply_ep

        expert_names = apply_ep(model, mesh, cfg)
        if mesh.dims.folded and mesh.dims.expert_tp > 1:  # the folded expert mesh's own hidden split
            from ndtrain.parallel.tp.moe_layers import apply_expert_tp

            apply_expert_tp(model, mesh)
    if mesh.dims.tp > 1:  # after ep: the plan's expert rows split the experts this rank holds
        from ndtrain.parallel.tp.tensor_parallel import apply_tp

        apply_tp(model, mesh, p.sequence_parallel, grad_reduce_dtype(cfg.training.dtype, p.grad_reduce_dtype),
                 p.expert_tp)
    if mesh.dims.cp > 1:
        from ndtrain.parallel.cp.context_parallel import apply_cp

        apply_cp(model, mesh, p.cp_impl, p.cp_layout, cp_ulysses=p.cp_ulysses, balance=batch.cp_balance)
    if cfg.finetune.lora_rank:
        from ndtrain.parallel.lora import apply_lora_parallel

        apply_lora_parallel(model, mesh, cfg, grad_reduce_dtype(cfg.training.dtype, p.grad_reduce_dtype))
    if cfg.training.fused_loss:
        from ndtrain.parallel.fused_head import apply_fused_loss

        batch.head = apply_fused_loss(model, batch)
    if cfg.training.activation_checkpoint != "none":
        from ndtrain.parallel.activation_ckpt import apply_activation_checkpoint

        apply_activation_checkpoint(model, cfg.training.activation_checkpoint)
    if cfg.training.fp8 or cfg.training.compile:
        from ndtrain.parallel.compile import apply_compile, apply_fp8

        if cfg.training.fp8:
            apply_fp8(model)
        if cfg.training.compile:
            apply_compile(model)
    if mesh.dims.pp > 1:  # stages hold disjoint parameters: grad-norm squares sum over pp
        from ndtrain.parallel.pp.stage import tag_pipeline_params

        tag_pipeline_params(model)
    if expert_names and p.zero_stage == 0:  # expert weights reduce over edp, the rest over dp (ep.expert_parallel)
        from ndtrain.parallel.ep.expert_parallel import ExpertDataParallel

        reduce_dtype = grad_reduce_dtype(cfg.training.dtype, p.grad_reduce_dtype)  # bf16 and fp16
        return ExpertDataParallel(model, mesh, cfg, expert_names, reduce_dtype)
    return apply_data_parallel(model, mesh, cfg, expert_names)  # ZeRO: experts sharded over edp_shard
