"""FSDP units: which modules form a unit, and sharding a unit's parameters (``fsdp.py`` runs them).

A unit is a list of *segments*, each a list of modules run back to back in forward. Its parameters
are sharded along dim 0 with padding into one flat master-dtype shard per rank
(``flat_shard.FlatShardLayout``); the modules keep unsharded compute-dtype ``nn.Parameter`` s under
their own names whose storage exists only while the unit is gathered.
"""
from __future__ import annotations

import torch
from torch import nn

from ndtrain.optim import SHARD_AXES_ATTR, shard_axes
from ndtrain.parallel.zero.flat_shard import FlatShardLayout
from ndtrain.parallel.zero.sharded_state import ShardEntry


def default_units(model: nn.Module) -> list[tuple[str, list[list[nn.Module]]]]:
    """``(name, segments)`` per unit; a segment is a list of modules run back to back in forward.

    Units: the embedding, each block, the head (final norm + output). With tied embeddings the
    head is a second segment of the embedding's unit (the shared weight lives in one unit). A model
    without ``layers`` is one unit.
    """
    if not hasattr(model, "layers"):
        return [("model", [[model]])]
    emb = getattr(model, "tok_embeddings", None)
    head = [m for m in (getattr(model, "norm", None), getattr(model, "output", None)) if m is not None]
    tied = emb is not None and head and any(p is emb.weight for p in head[-1].parameters())
    units = [("tok_embeddings", [[emb], head] if tied else [[emb]])] if emb is not None else []
    units += [(f"layers.{key}", [[layer]]) for key, layer in model.layers.items()]
    if head and not tied:
        units.append(("head", [head]))
    return units


class Unit:
    """One FSDP unit: its segments, unsharded params, flat shard, gather / reduce state."""

    def __init__(self, index: int, name: str, segments: list[list[nn.Module]]):
        self.index, self.name, self.segments = index, name, segments
        self.full: list[nn.Parameter] = []  # unsharded compute-dtype params registered in modules
        self.entries: list[ShardEntry] = []
        self.layout: FlatShardLayout | None = None
        self.shard: torch.Tensor | None = None  # (S,) master dtype
        self.state = "sharded"  # sharded | gathering | gathered
        self.gather = None  # (work, buf (N*S,), src (S,))
        self.ready = 0
        self.acc: torch.Tensor | None = None  # (S,) accumulated gradient shard, master dtype
        self.pending: list[tuple] = []  # reduce-scatters in flight: (work, out (S,), in (N*S,))


@torch.no_grad()
def shard_unit(u: Unit, mod_names: dict, owner_of: dict, by_name: dict, n: int, rank: int,
               master_dtype: torch.dtype, compute_dtype: torch.dtype) -> None:
    """Shard ``u``'s parameters: fill ``u.layout`` / ``u.shard`` (this rank's flat master shard),
    replace each parameter in its module by an unsharded compute-dtype ``nn.Parameter`` with a
    freed storage (``u.full``), and record a ``ShardEntry`` per parameter in ``u.entries`` and
    ``by_name`` (a tied parameter met twice in ``u`` gets its second name as an alias).

    Raises ValueError for a parameter already owned by another unit (``owner_of``: id -> (fqn, unit)).
    """
    owned, tied = [], []  # (fqn, owner module, attribute, param); tied: second owners
    for m in (m for seg in u.segments for m in seg):
        prefix = mod_names[id(m)]
        for sub_name, sub in m.named_modules():
            for attr, p in list(sub._parameters.items()):
                if p is None or not p.requires_grad:
                    continue
                fqn = ".".join(x for x in (prefix, sub_name, attr) if x)
                if id(p) in owner_of:
                    if owner_of[id(p)][1] is not u:
                        raise ValueError(f"{fqn} is shared with {owner_of[id(p)][0]} in another FSDP "
                                         "unit (tied weights must share a unit)")
                    tied.append((fqn, sub, attr, p))
                    continue
                owner_of[id(p)] = (fqn, u)
                owned.append((fqn, sub, attr, p))
    device = owned[0][3].device if owned else torch.device("cpu")
    u.layout = FlatShardLayout([p.shape for *_, p in owned], n, rank)
    u.shard = u.layout.shard_from_full([p.detach() for *_, p in owned],
                                       torch.empty(u.layout.shard_numel, dtype=master_dtype,
                                                   device=device))
    for i, (fqn, sub, attr, p) in enumerate(owned):
        sp = nn.Parameter(u.layout.shard_view(u.shard, i))
        full = nn.Parameter(torch.empty(p.shape, dtype=compute_dtype, device=device))
        for t in (sp, full):
            setattr(t, SHARD_AXES_ATTR, shard_axes(p))
        full.untyped_storage().resize_(0)
        sub._parameters[attr] = full
        u.full.append(full)
        e = ShardEntry(fqn, p.shape, u.layout, i, sp, shard_axes(p))
        for fqn2, sub2, attr2, p2 in tied:
            if p2 is p:  # the same unsharded Parameter in both places; the name is an alias
                sub2._parameters[attr2] = full
                e.aliases += (fqn2,)
        u.entries.append(e)
        by_name[fqn] = e
