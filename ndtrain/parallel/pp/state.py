"""Checkpoint state of a pipeline stage under the single-process names: ``flatten_param_groups``
keys groups by parameter name (positional groups fit no other stage) and stores the tied head's
moments under ``tok_embeddings.weight``; ``unflatten_param_groups`` inverts it. Whole tensors:
run after ``tp.state.gather_tp_state``, before ``scatter_tp_state``."""
from __future__ import annotations

from torch import nn

from ndtrain.parallel.pp.stage import stage_info


def tied_head_alias(model: nn.Module | None) -> dict[str, str]:
    """{"output.weight": "tok_embeddings.weight"} on the last stage of a tied model, else {}."""
    info = stage_info(model) if model is not None else None
    return {"output.weight": "tok_embeddings.weight"} if (info and info.tied and not info.first
                                                         and info.last) else {}


def flatten_param_groups(optim_sd: dict, model: nn.Module | None = None) -> dict:
    """The optimizer state as checkpointed: ``param_groups`` as ``{fqn: hyperparameters}``, the tied
    head under the embedding's name."""
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
    """Inverse: ``template``'s group lists, each group's hyperparameters from its first parameter."""
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
