"""Pipeline parallel in the trainer: tied embeddings across the end stages, global-norm clipping over
all stages, and ``StagePipeline``, the trainer's step path (pp == 1: one stage, no pipeline).

The first stage's embedding and the last stage's copy (tied head, or MTP's lookup) have the same
initial value; their gradients are summed over {pp 0, pp p-1} after the data-parallel reduction,
on whatever the optimizer steps, so both take identical steps. The norm counts the tied weight once.
Under DualPipeV rank 0 holds both ends: one copy, no group."""
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
    """The 2-rank group {pp 0, pp p-1} when this rank holds one end of a shared embedding, else None.
    Collective: every rank of the world must call it (``new_group``)."""
    p = mesh.dims.pp
    shared = cfg.model.tie_embeddings or cfg.model.mtp_depth > 0
    if p == 1 or not shared or cfg.parallel.pp_schedule == "dualpipev":  # V: both ends on rank 0
        return None
    pp = mesh.group("pp")
    if p == 2:
        return pp
    # the mesh is row-major over (pp, dp_replicate, dp_shard, cp, tp): stage s holds ranks
    # s*n .. s*n + n-1; arithmetic, not the mesh tensor, so also right under the rehearsal's fakes
    n = mesh.dims.world_size // p
    firsts, lasts = list(range(n)), list(range((p - 1) * n, p * n))
    mine = None
    me = dist.get_rank()
    for a, b in zip(firsts, lasts):  # same order on every rank
        pg = dist.new_group([a, b])
        if me in (a, b):
            mine = AxisGroup("pp", 2, 0 if me == a else 1, pg, pp.stats)
    return mine if pp.rank in (0, p - 1) else None


def tied_name(model: nn.Module) -> str | None:
    """This stage's copy of the shared embedding: the embedding on the first stage, the head or MTP's
    copy on the last; None elsewhere."""
    info = stage_info(model)
    if info is None or not info.shares_embedding:
        return None
    if info.first:
        return "tok_embeddings.weight"
    return ("tok_embeddings.weight" if info.mtp else "output.weight") if info.last else None


def grad_holder(model: nn.Module, dp, name: str) -> nn.Parameter:
    """The Parameter whose ``.grad`` the optimizer steps for ``name``: the model's own (DDP) or its master
    shard (ZeRO / FSDP; both tied copies' rows sit on the same dp rank)."""
    for e in getattr(dp, "entries", None) or []:
        if e.fqn == name or name in e.aliases:
            return e.param
    return model.get_parameter(name)


def sync_tied_grads(model: nn.Module, dp, group: AxisGroup | None) -> None:
    """Sum the tied embedding's gradient over the end stages (after the dp reduction). Bytes: V x C x b
    per rank (2-rank all-reduce), divided by the dp shard count under ZeRO / FSDP."""
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
    """``PipelineRuntime`` whose last stage arms the fused-loss head with each microbatch's labels
    (``training.fused_loss``): the head returns the loss sum and ``loss_fn`` passes it through."""

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

    ``loss_fn(logits, labels) -> sum CE`` (the layout's loss); ``m``: microbatches per step;
    ``labelled``: ``BatchPlan.labelled`` under ``training.fused_loss``. With pp == 1 this is each
    microbatch's forward then backward, all but the last under ``dp.no_sync()``: bitwise a plain
    gradient-accumulation loop (tests/unit/test_pp_one_stage.py)."""

    def __init__(self, model: nn.Module, dp, mesh: Mesh, cfg: Config, loss_fn, forward_ctx,
                 device: torch.device, m: int, labelled=None):
        self.model, self.dp, self.mesh, self.m = model, dp, mesh, m
        self.tied_group = build_tied_group(mesh, cfg)
        schedule = cfg.parallel.pp_schedule if mesh.dims.pp > 1 else "1f1b"  # one stage: F, B in turn
        p, t = cfg.parallel, cfg.training
        overlap = resolve_overlap(p.pp_overlap, mesh.dims.pp, schedule, p.tp, p.cp, p.zero_stage,
                                  t.activation_checkpoint, t.compile, torch.device(device).type,
                                  all_to_all=cfg.model.is_moe and p.ep > 1)
        self.runtime = LabelledRuntime(stage_chunks(model), mesh.group("pp"), schedule, loss_fn, dp,
                                       forward_ctx, device, labelled=labelled, overlap=overlap)

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, denom: float,
                         positions: torch.Tensor | None = None, extra_loss=None,
                         loss_scale: float = 1.0, documents: torch.Tensor | None = None) -> torch.Tensor:
        """All microbatches forward and backward; dp-reduced, tied-summed gradients in ``.grad``.
        inputs, labels: (B_local, T). Each backpropagates ``(loss_fn(logits, labels_mb) / denom +
        extra_loss(labels_mb)) * loss_scale``. Returns the local summed token loss (float64, every pp
        rank)."""
        extra = None if extra_loss is None else self._stage_extra(extra_loss)
        loss_sum = self.runtime.run(inputs, labels, self.m, denom, positions, train=True,
                                    extra_loss=extra, loss_scale=loss_scale, documents=documents)
        sync_tied_grads(self.model, self.dp, self.tied_group)
        return loss_sum

    def _stage_extra(self, extra_loss):
        """``extra_loss`` reading MTP logits: a chunk view's are moved to the stage model first."""
        views = [c for c in self.runtime.chunks if c is not self.model]

        def extra(labels: torch.Tensor):
            for view in views:
                if getattr(view, "mtp_logits", None):
                    self.model.mtp_logits, view.mtp_logits = view.mtp_logits, []
            return extra_loss(labels)

        return extra

    @torch.no_grad()
    def eval_loss_sum(self, inputs: torch.Tensor, labels: torch.Tensor,
                      positions: torch.Tensor | None = None, documents: torch.Tensor | None = None) -> torch.Tensor:
        """Forward-only pass of a local batch; the summed token loss on every pp rank."""
        return self.runtime.run(inputs, labels, min(self.m, inputs.shape[0]), 1.0, positions, train=False,
                                documents=documents)
