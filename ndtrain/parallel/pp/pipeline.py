"""Pipeline parallel in the trainer: tied embeddings across the first and last stage, global-norm
clipping over all stages, and ``StagePipeline`` (the trainer's
step path; with pp == 1 it is one stage running its microbatches in order, no pipeline).

Tied embeddings: the first stage's embedding and the last stage's head are separate copies with the
same initial value (``ndtrain.parallel.pp.stage``); an MTP model's last stage likewise holds a copy
of the embedding for MTP's lookup (``tok_embeddings``; with a tied head it is the head's Parameter
too). Their gradients are summed over the 2-rank group
{pp 0, pp p-1} after the data-parallel reduction, on whatever the optimizer steps (the model's
Parameter under DDP, its master shard under ZeRO / FSDP), so both copies take identical steps. The
global gradient norm counts the tied weight once. Under DualPipeV rank 0 holds both ends: one copy,
no group.

MoE / MTP: the runtime calls ``extra_loss`` after every chunk forward on every stage, so each stage
backpropagates its own MoE layers' auxiliary terms; the head's stage adds the MTP terms
(``StagePipeline.forward_backward`` moves a chunk view's MTP logits to the stage model first).
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from ndtrain.mesh import AxisGroup, Mesh
from ndtrain.model.mtp import feeding_token_ids
from ndtrain.parallel import comm
from ndtrain.parallel.pp.rules import resolve_overlap
from ndtrain.parallel.pp.runtime import PipelineRuntime
from ndtrain.parallel.pp.stage import stage_chunks, stage_info

if TYPE_CHECKING:  # annotations only: the config package validates with parallel's rules
    from ndtrain.config import Config


def build_tied_group(mesh: Mesh, cfg: Config) -> AxisGroup | None:
    """The 2-rank group {pp rank 0, pp rank p-1} of this rank's pipeline, when it holds one end of
    a shared embedding (tied head, or MTP's copy); else None. Collective: every rank of the world
    must call it (new_group)."""
    p = mesh.dims.pp
    shared = cfg.model.tie_embeddings or cfg.model.mtp_depth > 0
    if p == 1 or not shared or cfg.parallel.pp_schedule == "dualpipev":  # V: both ends on rank 0
        return None
    pp = mesh.group("pp")
    if p == 2:
        return pp
    ranks = mesh.device_mesh.mesh  # (pp, dp_replicate, dp_shard, cp, tp) global ranks
    firsts, lasts = ranks[0].flatten().tolist(), ranks[-1].flatten().tolist()
    mine = None
    me = dist.get_rank()
    for a, b in zip(firsts, lasts):  # same order on every rank
        pg = dist.new_group([a, b])
        if me in (a, b):
            mine = AxisGroup("pp", 2, 0 if me == a else 1, pg, pp.stats)
    return mine if pp.rank in (0, p - 1) else None


def tied_name(model: nn.Module) -> str | None:
    """Name of this stage's copy of the shared embedding: the embedding on the first stage; on the
    last the head (tied) or MTP's embedding copy; None elsewhere (or nothing shared, or V)."""
    info = stage_info(model)
    if info is None or not info.shares_embedding:
        return None
    if info.first:
        return "tok_embeddings.weight"
    return ("tok_embeddings.weight" if info.mtp else "output.weight") if info.last else None


def grad_holder(model: nn.Module, dp, name: str) -> nn.Parameter:
    """The Parameter whose ``.grad`` the optimizer steps for model parameter ``name``: the model's
    own under plain data parallel, its master shard under ZeRO / FSDP (``dp.entries``, dim-0
    shards: the same rows of both tied copies sit on the same data-parallel rank)."""
    for e in getattr(dp, "entries", None) or []:
        if e.fqn == name or name in e.aliases:
            return e.param
    return model.get_parameter(name)


def sync_tied_grads(model: nn.Module, dp, group: AxisGroup | None) -> None:
    """Sum the tied embedding's gradient over the first and last stage (after the data-parallel
    reduction, on whatever the optimizer steps). Bytes: V x C x b per rank (2-rank all-reduce),
    divided by the data-parallel shard count under ZeRO / FSDP."""
    name = tied_name(model)
    if group is None or name is None:
        return
    w = grad_holder(model, dp, name)
    if w.grad is None:
        w.grad = torch.zeros_like(w)
    comm.all_reduce(w.grad, group)


def uncounted_tied_copy(model: nn.Module, dp) -> tuple:
    """The last stage's copy of the tied embedding (the Parameter ``dp``'s optimizer steps), or ():
    global-norm clipping leaves it out of the norm (its gradient equals the first stage's after
    ``sync_tied_grads``) and scales it by the same coefficient (``GradSync.norm_uncounted``)."""
    info = stage_info(model)
    name = tied_name(model) if (info and info.last and not info.first) else None
    return (grad_holder(model, dp, name),) if name else ()


class LabelledRuntime(PipelineRuntime):
    """``PipelineRuntime`` whose last stage runs each microbatch's forward with the fused-loss head
    armed with that microbatch's labels (``training.fused_loss``, ``ndtrain.parallel.fused_head``):
    the head then returns the summed token loss and ``loss_fn`` passes it through.
    ``labelled(labels)``: a context factory (``BatchPlan.labelled``); None = plain runtime."""

    def __init__(self, *args, labelled=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.labelled = labelled

    def _forward(self, a, inp) -> None:
        st = self._step
        if st.s.stage(self.rank, a.chunk) != st.s.n_stages - 1:
            return super()._forward(a, inp)
        with contextlib.ExitStack() as ctx:  # the head's stage: labels for a fused loss, ids for MTP
            if self.labelled is not None:
                ctx.enter_context(self.labelled(st.ys[a.mb]))
            ctx.enter_context(feeding_token_ids(self.chunks[a.chunk], st.xs[a.mb]))
            return super()._forward(a, inp)


class StagePipeline:
    """The trainer's view of pipeline parallel: this rank's stage model, its runtime, tied grads.

    Args: the stage ``model`` (after ``parallelize``), its gradient synchroniser ``dp``, ``mesh``,
    ``cfg``, ``loss_fn(logits, labels) -> sum CE`` (the layout's loss, e.g. vocab-parallel),
    ``forward_ctx`` (autocast factory), ``device``, ``m`` (microbatches per step), ``labelled``
    (``BatchPlan.labelled`` under ``training.fused_loss``: the last stage's head computes the loss,
    so ``loss_fn`` receives the loss sum instead of logits).

    With pp == 1 the whole model is one stage and the schedule is 1F1B on one rank, i.e. each
    microbatch's forward then its backward, in order, every backward but the last under
    ``dp.no_sync()``, then ``dp.finish_grad_sync()``: the same operations, in the same order, as a
    plain gradient-accumulation loop (bitwise equal, ``tests/unit/test_pp_one_stage.py``).
    """

    def __init__(self, model: nn.Module, dp, mesh: Mesh, cfg: Config, loss_fn, forward_ctx,
                 device: torch.device, m: int, labelled=None):
        self.model, self.dp, self.mesh, self.m = model, dp, mesh, m
        self.tied_group = build_tied_group(mesh, cfg)
        schedule = cfg.parallel.pp_schedule if mesh.dims.pp > 1 else "1f1b"  # one stage: F, B in turn
        p, t = cfg.parallel, cfg.training
        overlap = resolve_overlap(p.pp_overlap, mesh.dims.pp, schedule, p.tp, p.cp, p.zero_stage,
                                  t.activation_checkpoint, t.compile, torch.device(device).type)
        self.runtime = LabelledRuntime(stage_chunks(model), mesh.group("pp"), schedule, loss_fn, dp,
                                       forward_ctx, device, labelled=labelled, overlap=overlap)

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, denom: float,
                         positions: torch.Tensor | None = None, extra_loss=None,
                         loss_scale: float = 1.0) -> torch.Tensor:
        """All microbatches forward and backward, DP-reduced and tied-summed gradients in ``.grad``.

        inputs, labels: (B_local, T). Each microbatch backpropagates ``(loss_fn(logits, labels_mb) /
        denom + extra_loss(labels_mb)) * loss_scale`` (``extra_loss``: optional MoE aux / MTP term,
        called after the microbatch's forward on the last stage). Returns the summed token loss
        of the local batch (float64, the same on every pp rank)."""
        extra = None if extra_loss is None else self._stage_extra(extra_loss)
        loss_sum = self.runtime.run(inputs, labels, self.m, denom, positions, train=True,
                                    extra_loss=extra, loss_scale=loss_scale)
        sync_tied_grads(self.model, self.dp, self.tied_group)
        return loss_sum

    def _stage_extra(self, extra_loss):
        """``extra_loss`` reading MTP logits from the stage model: a chunk view (interleaved,
        DualPipeV) keeps the ones its forward set on itself, so they are moved over first."""
        views = [c for c in self.runtime.chunks if c is not self.model]

        def extra(labels: torch.Tensor):
            for view in views:
                if getattr(view, "mtp_logits", None):
                    self.model.mtp_logits, view.mtp_logits = view.mtp_logits, []
            return extra_loss(labels)

        return extra

    @torch.no_grad()
    def eval_loss_sum(self, inputs: torch.Tensor, labels: torch.Tensor,
                      positions: torch.Tensor | None = None) -> torch.Tensor:
        """Forward-only pass of a local batch; the summed token loss on every pp rank."""
        return self.runtime.run(inputs, labels, min(self.m, inputs.shape[0]), 1.0, positions, train=False)
