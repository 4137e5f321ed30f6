"""Layout rules of hierarchical MoE dispatch and node-limited routing; raise ``ConfigError`` naming the
rule. Pure Python (the config package validates with them before any process starts).

A "node" is ``node_size`` consecutive global ranks. With tp == 1 an ep group is ``ep`` consecutive
ranks, so it either lies inside one node (ep <= node_size, node_size a multiple of ep) or spans
``ep / node_size`` whole nodes (ep a multiple of node_size); each node then holds the experts of its
``min(ep, node_size)`` ep ranks, a contiguous block of E / nodes experts."""
from __future__ import annotations

import os

from ndtrain.errors import require

DISPATCHES = ("flat", "hierarchical")
SPLIT_SCHEDULES = ("zero_bubble", "dualpipev")  # split backward / threaded pairs: flat dispatch only


def resolve_node_size(node_size: int, world_size: int | None) -> int | None:
    """``node_size`` if > 0, else torchrun's ``LOCAL_WORLD_SIZE``, else ``world_size`` (one launch on one
    machine); None when none is known."""
    if node_size > 0:
        return node_size
    env = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(env) if env else world_size


def _dp_shard(p, world_size: int | None) -> int:
    """dp_shard with -1 resolved from ``world_size``; 0 when unknown (nothing to check)."""
    d = getattr(p, "dp_shard", 0)
    if d != -1:
        return max(d, 0)
    fixed = p.pp * getattr(p, "dp_replicate", 1) * getattr(p, "cp", 1) * p.tp
    return world_size // fixed if world_size and fixed else 0


def ep_nodes(ep: int, node_size: int) -> int:
    """Nodes one ep group spans (rules above): ``ep / node_size`` when ep > node_size, else 1."""
    return max(1, ep // node_size)


def check(p, m, world_size: int | None = None) -> None:
    """``p``: a ``ParallelConfig`` (or the planner's look-alike), ``m``: a ``ModelConfig``. Rules:
    moe_dispatch flat | hierarchical; node_size >= 0; hierarchical needs ep > 1, tp 1, no shared-expert
    overlap and no split-backward pipeline schedule; with ep > 1, node_size divides ep or is a multiple
    of it; moe_max_nodes in 0..nodes spanned by an ep group, with top_k <= moe_max_nodes x experts per
    node, and (group-limited routing) groups nested in nodes with moe_topk_groups fitting in them."""
    dispatch, ep, tp = getattr(p, "moe_dispatch", "flat"), p.ep, p.tp
    node_size, max_nodes = getattr(p, "node_size", 0), getattr(m, "moe_max_nodes", 0)
    require(dispatch in DISPATCHES, f"parallel.moe_dispatch ({dispatch}) must be flat|hierarchical")
    require(node_size >= 0, f"parallel.node_size ({node_size}) must be >= 0 (0 = ranks per node of the launch)")
    require(max_nodes >= 0, f"model.moe_max_nodes ({max_nodes}) must be >= 0 (0 = off)")
    require(max_nodes == 0 or m.moe_experts > 0, "model.moe_max_nodes > 0 needs an MoE model (model.moe_experts > 0)")
    if dispatch == "hierarchical":
        require(ep > 1, f"parallel.moe_dispatch=hierarchical needs ep > 1 (ep={ep}): it is a form of the "
                "expert-parallel all-to-all")
        require(tp == 1, f"parallel.moe_dispatch=hierarchical needs tp 1 (tp={tp}): nodes are cut from "
                "consecutive ep ranks")
        borrow = _dp_shard(p, world_size) * getattr(p, "cp", 1)
        require(getattr(p, "expert_tp", 1) == 1 and (borrow == 0 or borrow % ep == 0),
                "parallel.moe_dispatch=hierarchical needs the ep ranks borrowed from dp_shard x cp (expert_tp 1, "
                "no folded expert mesh)")
        require(not getattr(p, "moe_shared_overlap", False),
                "parallel.moe_dispatch=hierarchical excludes parallel.moe_shared_overlap (flat dispatch only)")
        require(p.pp == 1 or p.pp_schedule not in SPLIT_SCHEDULES,
                f"parallel.moe_dispatch=hierarchical excludes pp_schedule {p.pp_schedule} (split backward / "
                "threaded pairs need the flat dispatch)")
    if max_nodes > 0 and ep > 1:
        require(tp == 1, f"model.moe_max_nodes > 0 with ep > 1 needs tp 1 (tp={tp}): nodes are cut from "
                "consecutive ep ranks")
    if ep == 1:  # one rank holds every expert: one node
        check_max_nodes(max_nodes, 1, m)
        return
    size = resolve_node_size(node_size, world_size)
    if size is None or (dispatch == "flat" and max_nodes == 0):
        return
    require(ep % size == 0 or size % ep == 0,
            f"parallel.node_size ({size}) must divide ep ({ep}) or be a multiple of it: an ep group lies in "
            "one node or spans whole nodes")
    check_max_nodes(max_nodes, ep_nodes(ep, size), m)


def check_max_nodes(max_nodes: int, nodes: int, m) -> None:
    """Node-limited routing fits: M <= nodes, k experts within M nodes, groups nested in nodes."""
    if max_nodes == 0:
        return
    e, k, g, tg = m.moe_experts, m.moe_top_k, m.moe_n_groups, m.moe_topk_groups
    require(max_nodes <= nodes, f"model.moe_max_nodes ({max_nodes}) exceeds the nodes an ep group spans ({nodes})")
    require(k <= max_nodes * (e // nodes), f"moe_top_k ({k}) exceeds the experts on moe_max_nodes ({max_nodes}) "
            f"nodes ({max_nodes} x {e // nodes})")
    if g > 1:
        require(g % nodes == 0, f"moe_n_groups ({g}) must be a multiple of the nodes an ep group spans ({nodes}) "
                "under model.moe_max_nodes: each group lies in one node")
        require(tg <= max_nodes * (g // nodes), f"moe_topk_groups ({tg}) exceeds the groups on moe_max_nodes "
                f"({max_nodes}) nodes ({max_nodes} x {g // nodes})")
