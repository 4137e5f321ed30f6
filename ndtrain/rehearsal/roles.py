"""The distinct rank roles of a layout: ranks that hold different model parts or different
amounts of them, so that rehearsing one rank of each covers the whole world.

Ranks differ only by their pipeline stage here: the blocks each pp rank holds (its virtual stages'
layers, ``ndtrain.parallel.pp.stage.plan_stage``), the embedding on the first stage, the final norm,
head and MTP modules on the last. Ranks of one stage are alike: tp / cp / dp / ep shards are even
(the layout rules require the divisions), and routing is not modelled (every expert rank is fed
alike). Each role's representative is its stage's rank 0 on every other axis."""
from __future__ import annotations

from dataclasses import dataclass, field

from ndtrain.config import Config


@dataclass
class Role:
    """One kind of rank: ``rank`` (global) represents ``ranks_alike`` ranks; ``stage`` (pp rank),
    ``layers`` (block ids held, all virtual stages), ``embedding`` / ``head`` / ``mtp`` (held here)."""

    name: str
    rank: int
    ranks_alike: int
    stage: int = 0
    layers: list[str] = field(default_factory=list)
    embedding: bool = True
    head: bool = True
    mtp: bool = False


def _ranges(ids: list[str]) -> str:
    """Block ids compactly: ["0", "1", "2", "5"] -> "0-2,5"; "-" for none."""
    out, nums = [], [int(i) for i in ids]
    for n in nums:
        if out and n == out[-1][1] + 1:
            out[-1][1] = n
        else:
            out.append([n, n])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out) or "-"


def rank_roles(cfg: Config, world: int, routing: str | None = None) -> list[Role]:
    """One ``Role`` per pipeline stage of ``cfg`` on ``world`` ranks (pp outermost in the mesh, so
    stage s's ranks are s * world / pp ...); under ``routing`` ``skewed:S`` two per stage: the
    busiest ep rank (ep rank 0, ``rehearsal.routing.skewed_assignment``) and the other ep ranks
    (alike: each gets the same smaller share), represented by ep rank 1 (mesh order (pp,
    dp_replicate, edp_shard, ep, tp): global rank + tp). ``cfg`` must be valid for ``world``."""
    roles = _stage_roles(cfg, world)
    if not (routing or "").startswith("skewed:") or cfg.parallel.ep < 2:
        return roles
    out, ep = [], cfg.parallel.ep
    for r in roles:
        busy = r.ranks_alike // ep
        out.append(Role(f"{r.name} | busiest ep rank", r.rank, busy, r.stage, r.layers, r.embedding, r.head, r.mtp))
        out.append(Role(f"{r.name} | other ep ranks", r.rank + cfg.parallel.tp, r.ranks_alike - busy, r.stage,
                        r.layers, r.embedding, r.head, r.mtp))
    return out


def _stage_roles(cfg: Config, world: int) -> list[Role]:
    p = cfg.parallel.pp
    per_stage = world // p
    if p == 1:
        layers = [str(i) for i in range(cfg.model.n_layers)]
        return [Role("all ranks", 0, world, 0, layers, True, True, cfg.model.mtp_depth > 0)]
    from ndtrain.parallel.pp.stage import plan_stage

    out = []
    for s in range(p):
        info = plan_stage(cfg, s)
        layers = [i for c in info.chunks for i in c]
        parts = [f"blocks {_ranges(layers)}"]
        parts += ["embedding"] if info.first else []
        parts += ["head"] if info.last else []
        parts += ["mtp"] if info.last and info.mtp else []
        out.append(Role(f"stage {s}: " + " + ".join(parts), s * per_stage, per_stage, s, layers,
                        info.first, info.last, info.last and info.mtp))
    return out
