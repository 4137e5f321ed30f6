"""FSDP units (which modules form a unit) and sharding a unit's parameters (``fsdp`` runs them).

A unit is a list of segments, each modules run back to back in forward. Under ep each MoE layer's
experts are a unit nested in their block's, in the expert domain (``edp_shard``); the block's unit
skips the nested unit's parameters."""
from __future__ import annotations

import torch
from torch import nn

from ndtrain.optim import SHARD_AXES_ATTR, shard_axes
from ndtrain.parallel.zero.flat_shard import FlatShardLayout
from ndtrain.parallel.zero.sharded_state import ShardEntry


def default_units(model: nn.Module) -> list[tuple[str, list[list[nn.Module]]]]:
    """``(name, segments)`` per unit: the embedding, each block, the head, each MTP depth (a model without
    ``layers`` is one unit). A tied head is a second segment of the embedding's unit. With MTP, which
    calls embedding and head again per depth, the head's norm and output are separate segments and
    depth k's unit ``mtp.k`` has two (the module's children, then its ``norm``)."""
    if not hasattr(model, "layers"):
        return [("model", [[model]])]
    mtp = getattr(model, "mtp", None)
    emb = getattr(model, "tok_embeddings", None)
    head = [m for m in (getattr(model, "norm", None), getattr(model, "output", None)) if m is not None]
    tied = emb is not None and head and any(p is emb.weight for p in head[-1].parameters())
    head_segs = [[m] for m in head] if mtp is not None else [head]
    units = [("tok_embeddings", [[emb]] + head_segs if tied else [[emb]])] if emb is not None else []
    units += [(f"layers.{key}", [[layer]]) for key, layer in model.layers.items()]
    if head and not tied:
        units.append(("head", head_segs))
    for key, module in (mtp.items() if mtp is not None else ()):
        body = [m for name, m in module.named_children() if name != "norm"]
        units.append((f"mtp.{key}", [body, [module.norm]]))
    return units


def expert_units(model: nn.Module, expert_names) -> list[tuple[str, list[list[nn.Module]]]]:
    """One unit per module holding ``expert_names`` parameters, in registration order."""
    owners = {n.rsplit(".", 1)[0] for n in expert_names}
    return [(name, [[m]]) for name, m in model.named_modules() if name in owners]


class Unit:
    """One FSDP unit: its segments, shard domain, unsharded params, flat shard, gather / reduce state."""

    def __init__(self, index: int, name: str, segments: list[list[nn.Module]], domain=None):
        self.index, self.name, self.segments, self.domain = index, name, segments, domain
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
def shard_unit(u: Unit, mod_names: dict, owner_of: dict, by_name: dict, master_dtype: torch.dtype,
               compute_dtype: torch.dtype, skip: frozenset[int] = frozenset()) -> None:
    """Shard ``u``'s parameters over ``u.domain.shard_group`` (``skip``: nested units' ids): fill
    ``u.layout`` / ``u.shard``, replace each parameter by an unsharded compute-dtype one with freed
    storage (``u.full``), record ``ShardEntry``s (a tied parameter's second name is an alias). Raises
    ValueError for a parameter owned by another unit."""
    owned, tied = [], []  # (fqn, owner module, attribute, param); tied: second owners
    for m in (m for seg in u.segments for m in seg):
        prefix = mod_names[id(m)]
        for sub_name, sub in m.named_modules():
            for attr, p in list(sub._parameters.items()):
                if p is None or not p.requires_grad or id(p) in skip:
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
    group = u.domain.shard_group
    u.layout = FlatShardLayout([p.shape for *_, p in owned], group.size, group.rank)
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
        e = ShardEntry(fqn, p.shape, u.layout, i, sp, shard_axes(p), domain=u.domain)
        for fqn2, sub2, attr2, p2 in tied:
            if p2 is p:  # the same unsharded Parameter in both places; the name is an alias
                sub2._parameters[attr2] = full
                e.aliases += (fqn2,)
        u.entries.append(e)
        by_name[fqn] = e
