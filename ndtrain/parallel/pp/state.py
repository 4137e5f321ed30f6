"""Checkpoint state of a pipeline stage under the single-process model's names.

A stage's optimizer state dict lists its parameter groups by position, which fits no other stage
or pp degree, and the last stage of a tied model holds its copy of the embedding as
``output.weight``. ``flatten_param_groups`` keys the groups by parameter name and stores the tied
head's moments under ``tok_embeddings.weight``, the name a single-process optimizer uses for the
tied Parameter (both stages hold identical moments after ``sync_tied_grads``);
``unflatten_param_groups`` is the inverse. Both work on whole tensors: run them after
``ndtrain.parallel.tp.state.gather_tp_state`` and before ``scatter_tp_state``, which find
tensor-parallel specs by the stage's own names (``ndtrain.parallel.state`` composes the order).
"""
from __future__ import annotations

from torch import nn

from ndtrain.parallel.pp.stage import stage_info


def tied_head_alias(model: nn.Module | None) -> dict[str, str]:
    """{"output.weight": "tok_embeddings.weight"} on the last stage of a tied model, else {}."""
    info = stage_info(model) if model is not None else None
    return {"output.weight": "tok_embeddings.weight"} if (info and info.tied and not info.first
                                                         and info.last) else {}


def flatten_param_groups(optim_sd: dict, model: nn.Module | None = None) -> dict:
    """The optimizer state dict as checkpointed: ``param_groups`` keyed by parameter name
    (``{fqn: {"lr": ..., ...}}``, not a list of groups each listing its FQNs: pipeline stages hold
    different parameters, so one list -- one checkpoint key, saved once -- fits no other stage),
    and the last stage's tied head stored under the embedding's name."""
    alias = tied_head_alias(model)
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
    alias = tied_head_alias(model)
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
