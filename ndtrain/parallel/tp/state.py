"""Checkpoint state of a tensor-parallel model under the model's own names and global shapes.

The data-parallel wrappers (DDP, ZeRO, FSDP) present each parameter, and its AdamW moments, as
what this rank holds of it: for a TP-split parameter that is the rank's slice, padded rows
included, under the full parameter's name. Saved like that, the tp ranks would write different
tensors under one name. ``gather_tp_state`` therefore replaces every TP-split entry with the whole
tensor (vocabulary padding dropped) on every rank, so the checkpoint is layout-independent: DCP
de-duplicates the replicas and the files load into any layout. ``scatter_tp_state`` is the inverse
after loading.

Cost: at save / load time each rank briefly holds every TP-split tensor whole (an all-gather over
tp per tensor; DTensor shards of ZeRO-3 / FSDP are first gathered over the data-parallel mesh).
A 2-D (data x tensor) DTensor layout would avoid that and is not implemented. Expert weights of
expert parallel (DTensor ``Shard(0)`` over ``ep``, split over tp along F with ``expert_tp = tp``)
keep their ep sharding: only the tp split is completed, on each rank's block of experts.
"""
from __future__ import annotations

import torch
from torch import nn

from ndtrain.mesh import Mesh
from ndtrain.parallel.tp.tensor_parallel import tp_full_tensor, tp_local_slice, tp_specs

MOMENTS = ("exp_avg", "exp_avg_sq", "momentum_buffer")  # AdamW, Muon


def _ep_dtensor(value, spec) -> bool:
    """An expert weight's DTensor over the ``ep`` mesh (``ExpertDataParallel``) whose shard dim (the
    experts) is not the tp dim: its tp split is completed on the local block, the ep shards stay."""
    from torch.distributed.tensor import DTensor, Shard

    return (isinstance(value, DTensor) and value.device_mesh.mesh_dim_names == ("ep",)
            and all(isinstance(pl, Shard) and pl.dim != spec[0] for pl in value.placements))


def _full(value, spec, group) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if _ep_dtensor(value, spec):
        local = tp_full_tensor(value.to_local().detach(), spec, group)
        return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False)
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return tp_full_tensor(value.detach(), spec, group)


def _local(value, spec, group) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if _ep_dtensor(value, spec):
        local = tp_local_slice(value.to_local(), spec, group)
        return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False)
    return tp_local_slice(value, spec, group)


def _map(state: dict, model: nn.Module, fn) -> dict:
    specs = tp_specs(model)
    out = dict(state)
    if "model" in state:
        out["model"] = {k: (fn(v, specs[k]) if k in specs else v) for k, v in state["model"].items()}
    if "optim" in state:
        opt = dict(state["optim"])
        opt["state"] = {k: ({n: (fn(t, specs[k]) if n in MOMENTS else t) for n, t in st.items()}
                            if k in specs else st) for k, st in state["optim"]["state"].items()}
        out["optim"] = opt
    return out


def gather_tp_state(state: dict, model: nn.Module, mesh: Mesh) -> dict:
    """``{"model": {fqn: t}, "optim": {"state": {fqn: {...}}, ...}}`` with every TP-split tensor
    replaced by the whole, unpadded tensor (a plain tensor, identical on every rank). Collective
    over ``tp`` (and over data parallel for DTensor entries); identity when tp == 1."""
    tp = mesh.group("tp")
    if tp.size == 1:
        return state
    return _map(state, model, lambda v, spec: _full(v, spec, tp))


def scatter_tp_state(state: dict, model: nn.Module, mesh: Mesh) -> dict:
    """Inverse of ``gather_tp_state``: whole tensors -> this rank's padded TP slices, ready for the
    data-parallel wrapper's ``load_*_state_dict`` (which accept whole tensors of the local shape)."""
    tp = mesh.group("tp")
    if tp.size == 1:
        return state
    return _map(state, model, lambda v, spec: _local(v, spec, tp))
