"""Shard domains: where parameters are sharded and replicated, and how a shard presents itself as a
global tensor (docs/moe.md, "Expert parallel with ZeRO-1/2/3 and HSDP").

dense: sharded over ``dp_shard_cp``, replicated over ``dp_replicate``. expert (ep > 1): the E/ep
local experts sharded over ``edp_shard``, replicated over ``dp_replicate`` (torchtitan's and
Megatron-Core's expert data parallel). An expert weight is DTensor ``(Shard(0), Shard(d))`` over
(ep, edp_shard), d = 0, or 1 when the E/ep local experts are fewer than the edp_shard ranks
(``flat_shard.shard_dim``: each rank then holds a slice of every local expert, not padding);
``ndtrain.mesh`` orders those dims the other way, so the expert domain builds its
own ``DeviceMesh`` over the same ranks with them swapped. Checkpoints then hold each expert tensor
once under its single-process name and shape."""
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
    """Parameters sharded over ``shard_group``, replicated over ``replicate_group``. ``name`` "dense" |
    "expert"; ``ep``: the ep AxisGroup (expert only); ``dmesh`` / ``placements``: the DTensor
    presentation (None: one shard is the whole tensor)."""

    def __init__(self, name: str, shard_group, replicate_group, dmesh=None, placements=None, ep=None):
        self.name, self.shard_group, self.replicate_group = name, shard_group, replicate_group
        self.dmesh, self.placements, self.ep = dmesh, placements, ep

    def global_shape(self, shape: torch.Size) -> torch.Size:
        """Global shape of a parameter whose rank-local (pre-ZeRO) shape is ``shape``."""
        if self.ep is None:
            return torch.Size(shape)
        return torch.Size((shape[0] * self.ep.size, *shape[1:]))

    def present(self, local: torch.Tensor, shape: torch.Size, dim: int = 0):
        """This rank's valid rows ``local`` (in the parameter's dim order, sharded along ``dim``) as
        the global tensor: a DTensor viewing ``local`` (``dcp.load`` writes in place), or ``local``
        itself. A 0-d parameter is broadcast whole (a 0-d DTensor cannot be sharded)."""
        if self.dmesh is None:
            return local.view(shape)
        if len(shape) == 0:
            t = local.reshape(-1)[:1].clone() if local.numel() else local.new_zeros(1)
            comm.broadcast(t, self.shard_group, 0)
            return t.view(())
        from torch.distributed.tensor import DTensor, Shard

        placements = list(self.placements)
        if self.shard_group.size > 1:  # the ZeRO shard dim is the last placement
            placements[-1] = Shard(dim)
        full = self.global_shape(shape)
        return DTensor.from_local(local, self.dmesh, placements, run_check=False, shape=full,
                                  stride=contiguous_stride(full))

    def local_rows(self, src, e) -> torch.Tensor:
        """This rank's valid rows of ``e``, row-first (``FlatShardLayout.rows_of``), from a DTensor of
        this layout or a whole tensor (sliced)."""
        from torch.distributed.tensor import DTensor

        if isinstance(src, DTensor):
            return e.layout.rows_of(src.to_local(), e.index)
        if self.ep is not None and src.dim() > 0:
            el = src.shape[0] // self.ep.size
            src = src[self.ep.rank * el:(self.ep.rank + 1) * el]
        lo, hi = e.layout.row_range(e.index)
        return e.layout.rows_of(src, e.index)[lo:hi]


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
    """Sharded over ``edp_shard``, replicated over ``dp_replicate``, presented over ``(dp_replicate,)
    ep, edp_shard``. Raises ValueError for ep == 1 (experts are then dense parameters)."""
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
