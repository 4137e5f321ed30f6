"""Shard domains of ZeRO-1/2/3 and HSDP: over which ranks a set of parameters is sharded, over
which its shards are replicated, and how a shard presents itself as a global tensor (the
checkpoint contract of ``sharded_state``).

* **dense** (every parameter of a model without expert parallel, and the non-expert parameters of
  one with it): sharded over ``dp_shard_cp``, replicated over ``dp_replicate`` -- ZeRO
  (Rajbhandari et al. 2020) and HSDP as always. Presented as a DTensor ``Shard(0)`` over
  ``dp_shard_cp`` (``(Replicate(), Shard(0))`` with ``dp_replicate``).
* **expert** (ep > 1; the routed experts ``apply_ep`` left on this rank, E/ep of them): the ranks
  holding the same experts form ``edp`` = dp_replicate x edp_shard (``ndtrain.mesh``); the experts
  are sharded along dim 0 over ``edp_shard`` = dp_shard x cp / ep and replicated over
  ``dp_replicate``, so a ZeRO-3 expert unit is gathered, and its gradients reduce-scattered, only
  across ``edp_shard`` (torchtitan's and Megatron-Core's expert-data-parallel sharding).

An expert weight of global shape (E, ...) is therefore cut twice along dim 0: into ep blocks of
E/ep experts (ep rank r holds block r), then each block into edp_shard padded row chunks
(``flat_shard``: ``torch.chunk`` semantics). That is DTensor's nested ``(Shard(0), Shard(0))`` over
a mesh whose ``ep`` dim comes *before* ``edp_shard``; ``ndtrain.mesh`` orders them the other way
(edp_shard outer, ep inner, as torchtitan's ``dp_shard_mod_ep`` x ``dp_shard_in_ep``), so the
expert domain builds its own ``DeviceMesh`` over the same ranks with the two dims swapped
(``(dp_replicate,) ep, edp_shard``; no rank changes its data). A checkpoint then stores every expert
tensor once under its single-process name and global shape, and DCP reshards it to any ep /
ZeRO stage / world size, one process included.
"""
from __future__ import annotations

import weakref

import torch

from ndtrain.parallel import comm

# Mesh -> the expert DeviceMesh with ep before edp_shard: built once per Mesh (DeviceMesh
# creates process groups, collectively), freed with it.
_EXPERT_DMESH: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


class ShardDomain:
    """A set of parameters sharded over ``shard_group`` and replicated over ``replicate_group``.

    Attributes: ``name`` ("dense" | "expert"), ``shard_group`` / ``replicate_group``
    (``AxisGroup``), ``ep`` (the ``ep`` AxisGroup for the expert domain: local dim 0 = global
    dim 0 / ep; None for dense), ``dmesh`` / ``placements`` (the DTensor presentation; None: one
    shard is the whole tensor).
    """

    def __init__(self, name: str, shard_group, replicate_group, dmesh=None, placements=None, ep=None):
        self.name, self.shard_group, self.replicate_group = name, shard_group, replicate_group
        self.dmesh, self.placements, self.ep = dmesh, placements, ep

    def global_shape(self, shape: torch.Size) -> torch.Size:
        """Global shape of a parameter whose rank-local (pre-ZeRO) shape is ``shape``."""
        if self.ep is None:
            return torch.Size(shape)
        return torch.Size((shape[0] * self.ep.size, *shape[1:]))

    def present(self, local: torch.Tensor, shape: torch.Size):
        """This rank's valid rows ``local`` of a parameter of rank-local shape ``shape`` as the
        global tensor: a DTensor whose local tensor is a view of ``local`` (so ``dcp.load`` writes
        in place), or ``local`` itself when one shard is the whole tensor. A 0-d parameter (dense
        only) is whole on every rank, broadcast from the shard rank holding it (a 0-d DTensor
        cannot be sharded)."""
        if self.dmesh is None:
            return local.view(shape)
        if len(shape) == 0:
            t = local.reshape(-1)[:1].clone() if local.numel() else local.new_zeros(1)
            comm.broadcast(t, self.shard_group, 0)
            return t.view(())
        from torch.distributed.tensor import DTensor

        full = self.global_shape(shape)
        return DTensor.from_local(local, self.dmesh, self.placements, run_check=False, shape=full,
                                  stride=contiguous_stride(full))

    def local_rows(self, src, e) -> torch.Tensor:
        """This rank's valid rows of entry ``e`` from ``src``: a DTensor of this domain's layout
        (its local tensor) or a whole global tensor (sliced: the ep block, then the row chunk)."""
        from torch.distributed.tensor import DTensor

        if isinstance(src, DTensor):
            return src.to_local()
        if self.ep is not None and src.dim() > 0:
            el = src.shape[0] // self.ep.size
            src = src[self.ep.rank * el:(self.ep.rank + 1) * el]
        lo, hi = e.layout.row_range(e.index)
        return src.reshape(-1)[lo:hi] if src.dim() == 0 else src[lo:hi]


def dense_domain(mesh) -> ShardDomain:
    """Sharded over ``dp_shard_cp``, replicated over ``dp_replicate``."""
    from torch.distributed.tensor import Replicate, Shard

    shard = mesh.group("dp_shard_cp")
    rep = mesh.group("dp_replicate")
    if mesh.device_mesh is None or shard.size == 1:
        return ShardDomain("dense", shard, rep)  # shards are whole tensors: plain tensors
    # with cp = 1 the root's dp_shard dim is dp_shard_cp (same ranks, same order); slicing a
    # flattened dim out of the root mesh is deprecated
    shard_dim = "dp_shard" if mesh.dims.cp == 1 else "dp_shard_cp"
    if rep.size > 1:
        return ShardDomain("dense", shard, rep, mesh.device_mesh["dp_replicate", shard_dim],
                           (Replicate(), Shard(0)))
    return ShardDomain("dense", shard, rep, mesh.device_mesh[shard_dim], (Shard(0),))


def expert_domain(mesh) -> ShardDomain:
    """Sharded over ``edp_shard``, replicated over ``dp_replicate``; presented over
    ``(dp_replicate,) ep, edp_shard`` (see module docstring). Needs ep > 1 (so a process group).

    Raises ValueError for ep == 1 (the experts are then ordinary dense parameters).
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard

    ep, shard, rep = mesh.group("ep"), mesh.group("edp_shard"), mesh.group("dp_replicate")
    if ep.size == 1 or mesh.ep_device_mesh is None:
        raise ValueError("the expert shard domain needs parallel.ep > 1")
    if mesh not in _EXPERT_DMESH:
        src = mesh.ep_device_mesh  # (pp, dp_replicate, edp_shard, ep, tp)
        names = ("pp", "dp_replicate", "ep", "edp_shard", "tp")
        _EXPERT_DMESH[mesh] = DeviceMesh(src.device_type, src.mesh.permute(0, 1, 3, 2, 4), mesh_dim_names=names)
    root = _EXPERT_DMESH[mesh]
    dims = [d for d, g in (("dp_replicate", rep), ("ep", ep), ("edp_shard", shard)) if g.size > 1]
    placements = tuple(Replicate() if d == "dp_replicate" else Shard(0) for d in dims)
    dmesh = root[tuple(dims)] if len(dims) > 1 else root[dims[0]]
    return ShardDomain("expert", shard, rep, dmesh, placements, ep)
