"""The configuration sweep's folded expert meshes (``ndtrain.mesh``; docs/moe.md, "The folded
expert mesh"): (world, parallel overrides) that MoE features run besides the other layouts."""
from __future__ import annotations

# ep spanning tp (with and without SP), expert_tp over ranks other than the attention tp (alone and
# under ep)
FOLDED = (
    (4, {"dp_shard": 2, "tp": 2, "ep": 4}), (4, {"dp_shard": 2, "tp": 2, "sequence_parallel": True, "ep": 4}),
    (2, {"dp_shard": 2, "expert_tp": 2}), (4, {"dp_shard": 4, "ep": 2, "expert_tp": 2}),
)


def folded_name(par: dict) -> list[str]:
    """The layout-name part of an expert_tp under tp 1 (split over its own ranks): ``["expert_tp2"]``,
    else ``[]`` (under tp the tp part names it)."""
    etp = par.get("expert_tp", 1)
    return [f"expert_tp{etp}"] if etp > 1 and par.get("tp", 1) == 1 else []
