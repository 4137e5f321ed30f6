"""Pipeline parallel in the trainer: tied embeddings across the first and last stage, global-norm
clipping over all stages, checkpoint-ready optimizer state, and ``StagePipeline`` (what
``ndtrain.train.Trainer`` calls when pp > 1).

Tied embeddings: the first stage's embedding and the last stage's head are separate copies with the
same initial value (``ndtrain.parallel.pp.stage``); their gradients are summed over the 2-rank group
{pp 0, pp p-1} after the data-parallel reduction, on whatever the optimizer steps (the model's
Parameter under DDP, its master shard under ZeRO / FSDP), so both copies take identical steps. The
global gradient norm counts the tied weight once.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ndtrain.config import Config
from ndtrain.mesh import AxisGroup, Mesh
from ndtrain.parallel import comm
from ndtrain.parallel.pp.stage import stage_chunks, stage_info


def build_tied_group(mesh: Mesh, cfg: Config) -> AxisGroup | None:
    """The 2-rank group {pp rank 0, pp rank p-1} of this rank's pipeline, when it holds one end of
    a tied embedding; else None. Collective: every rank of the world must call it (new_group)."""
    p = mesh.dims.pp
    if p == 1 or not cfg.model.tie_embeddings:
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
    """Name of this stage's copy of the tied embedding: the embedding on the first stage, the head
    on the last, None elsewhere (or untied)."""
    info = stage_info(model)
    if info is None or not info.tied:
        return None
    return "tok_embeddings.weight" if info.first else ("output.weight" if info.last else None)


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


def _tied_head_alias(model: nn.Module | None) -> dict[str, str]:
    """{"output.weight": "tok_embeddings.weight"} on the last stage of a tied model, else {}."""
    info = stage_info(model) if model is not None else None
    return {"output.weight": "tok_embeddings.weight"} if (info and info.tied and not info.first
                                                         and info.last) else {}


def flatten_param_groups(optim_sd: dict, model: nn.Module | None = None) -> dict:
    """The optimizer state dict as checkpointed: ``param_groups`` keyed by parameter name
    (``{fqn: {"lr": ..., ...}}``, not a list of groups each listing its FQNs: pipeline stages hold
    different parameters, so one list -- one checkpoint key, saved once -- fits no other stage),
    and the last stage's tied head stored under the embedding's name, the name a single-process
    optimizer uses for the tied Parameter (both stages hold identical moments)."""
    alias = _tied_head_alias(model)
    out = dict(optim_sd)
    if alias and isinstance(out.get("state"), dict):
        out["state"] = {alias.get(k, k): v for k, v in out["state"].items()}
    groups = out.get("param_groups")
    if isinstance(groups, list):
        out["param_groups"] = {alias.get(f, f): {k: v for k, v in g.items() if k != "params"}
                               for g in groups for f in g["params"]}
    return out


def unflatten_param_groups(optim_sd: dict, template: dict, model: nn.Module | None = None) -> dict:
    """Inverse of ``flatten_param_groups``: the group lists of ``template`` (this layout's own
    ``optim_state_dict``), each group's hyperparameters taken from its first parameter's entry."""
    alias = _tied_head_alias(model)
    out = dict(optim_sd)
    if alias and isinstance(out.get("state"), dict):
        back = {v: k for k, v in alias.items()}
        out["state"] = {back.get(k, k): v for k, v in out["state"].items()}
    flat = out.get("param_groups")
    if isinstance(flat, dict):
        groups = []
        for g in template["param_groups"]:
            saved = next((flat[alias.get(f, f)] for f in g["params"] if alias.get(f, f) in flat), {})
            groups.append({**g, **saved, "params": g["params"]})
        out["param_groups"] = groups
    return out


def clip_grad_norm(model: nn.Module, dp, max_norm: float, mesh: Mesh) -> float:
    """Global-norm clipping over all stages: ``dp.clip_grad_norm`` sums squared norms over the
    parameters' shard axes (which include "pp"); the last stage's tied head is left out of the
    norm (its gradient equals the first stage's embedding gradient after ``sync_tied_grads``) and
    scaled with the same coefficient as ``ndtrain.optim.clip_grad_norm`` applies. Returns the norm
    before clipping."""
    info = stage_info(model)
    dup = grad_holder(model, dp, "output.weight") if (info and info.tied and info.last) else None
    held = None
    if dup is not None:
        held, dup.grad = dup.grad, None
    norm = dp.clip_grad_norm(max_norm, mesh)
    if dup is not None:
        dup.grad = held
        if held is not None and max_norm > 0 and norm > max_norm:
            held.mul_(max_norm / (norm + 1e-6))  # the coefficient of optim.clip_grad_norm
    return norm


class StagePipeline:
    """The trainer's view of pipeline parallel: this rank's stage model, its runtime, tied grads.

    Args: the stage ``model`` (after ``parallelize``), its gradient synchroniser ``dp``, ``mesh``,
    ``cfg``, ``loss_fn(logits, labels) -> sum CE`` (the layout's loss, e.g. vocab-parallel),
    ``forward_ctx`` (autocast factory), ``device``, ``m`` (microbatches per step).
    """

    def __init__(self, model: nn.Module, dp, mesh: Mesh, cfg: Config, loss_fn, forward_ctx,
                 device: torch.device, m: int):
        from ndtrain.parallel.pp.runtime import PipelineRuntime

        self.model, self.dp, self.mesh, self.m = model, dp, mesh, m
        self.tied_group = build_tied_group(mesh, cfg)
        self.runtime = PipelineRuntime(stage_chunks(model), mesh.group("pp"), cfg.parallel.pp_schedule,
                                       loss_fn, dp, forward_ctx, device, seed=cfg.training.seed)

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, denom: float,
                         positions: torch.Tensor | None = None) -> torch.Tensor:
        """All microbatches forward and backward, DP-reduced and tied-summed gradients in ``.grad``.
        Returns the summed token loss of the local batch (float64, the same on every pp rank)."""
        loss_sum = self.runtime.run(inputs, labels, self.m, denom, positions, train=True)
        sync_tied_grads(self.model, self.dp, self.tied_group)
        return loss_sum

    def clip_grad_norm(self, max_norm: float) -> float:
        return clip_grad_norm(self.model, self.dp, max_norm, self.mesh)

    @torch.no_grad()
    def eval_loss_sum(self, inputs: torch.Tensor, labels: torch.Tensor,
                      positions: torch.Tensor | None = None) -> torch.Tensor:
        """Forward-only pass of a local batch; the summed token loss on every pp rank."""
        return self.runtime.run(inputs, labels, min(self.m, inputs.shape[0]), 1.0, positions, train=False)
