"""Hierarchical MoE dispatch (DeepSeek-V3's node-deduplicated all-to-all; docs/moe.md, "Hierarchical
dispatch"): a token crosses to each remote node at most once, the node forwards it to the ranks that
hold its chosen experts, and the combine runs in reverse (weighted sum inside the node, one copy back).

The ep group (ep = nodes x g consecutive ranks, ``hier_rules``) is cut two ways: ``intra`` (the g ranks
of one node) and ``inter`` (the ``nodes`` ranks with the same local index, one per node: a token's
*gateway* in node n is the rank of n with the sender's local index). Per MoE layer and forward:

1. inter all-to-all: one row per (token, destination node) pair, plus each assignment's weight and
   (expert, row) metadata;
2. intra all-to-all: the gateway sends each assignment's row to the rank owning its expert; the local
   grouped GEMM; the reverse intra all-to-all;
3. the gateway multiplies by the routing weights and sums per row (index_add); the reverse inter
   all-to-all returns one row per (token, node).

Backward is the reverse of each autograd all-to-all (``AllToAllV``). Bytes: token rows on ``ep_inter``
and ``ep_intra``; weights, metadata and counts on ``ep_route``. Per layer and direction, over the
whole ep group: ``ep_inter = P C b`` with P the (token, remote node) pairs, flat dispatch's share that
leaves the node ``A_remote C b`` with A_remote the assignments whose expert is on another node.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ndtrain.mesh import AxisGroup, Mesh
from ndtrain.model.moe import GroupedExperts
from ndtrain.model.moe_autograd import scatter_rows, weighted_sum
from ndtrain.parallel.ep.collectives import AllToAllV, all_to_all_v
from ndtrain.parallel.ep.hier_rules import ep_nodes
from ndtrain.parallel.ep.layers import ExpertParallelExperts


@dataclass
class NodeGroups:
    """This rank's cut of its ep group: ``inter`` / ``intra`` count token rows, ``inter_route`` /
    ``intra_route`` (same process groups) count routing metadata. ``nodes`` x ``per_node`` = ep."""

    nodes: int
    per_node: int
    inter: AxisGroup
    intra: AxisGroup
    inter_route: AxisGroup
    intra_route: AxisGroup


def node_groups(mesh: Mesh, node_size: int) -> NodeGroups:
    """The intra- / inter-node groups of this rank's ep group, built once per mesh (cached on it).
    Collective: every rank builds every group in the same order (``new_group``). Raises ValueError if an
    ep group's node block holds ranks of two nodes (``hier_rules`` prevents it for tp 1)."""
    cached = getattr(mesh, "_ndtrain_node_groups", None)
    if cached is not None:
        return cached
    import torch.distributed as dist

    ep = mesh.dims.ep
    nodes = ep_nodes(ep, node_size)
    g = ep // nodes
    me = dist.get_rank()
    rows = mesh.ep_device_mesh.mesh.movedim(3, -1).reshape(-1, ep).tolist()  # every ep group, ep order
    mine = {}
    for row in rows:
        blocks = [row[n * g:(n + 1) * g] for n in range(nodes)]
        for b in blocks:
            if len({r // node_size for r in b}) != 1:
                raise ValueError(f"ep ranks {b} of one node block lie on different nodes (node_size {node_size})")
        cuts = [("intra", b) for b in blocks] + [("inter", [b[l] for b in blocks]) for l in range(g)]
        for kind, members in cuts:
            pg = dist.new_group(members) if len(members) > 1 else None
            if me in members:
                mine[kind] = (pg, members.index(me))
    stats = mesh.stats

    def make(kind: str, name: str, size: int) -> AxisGroup:
        pg, rank = mine[kind]
        return AxisGroup(name, size, rank, pg, stats)

    out = NodeGroups(nodes, g, make("inter", "ep_inter", nodes), make("intra", "ep_intra", g),
                     make("inter", "ep_route", nodes), make("intra", "ep_route", g))
    mesh._ndtrain_node_groups = out
    return out


class HierarchicalExperts(ExpertParallelExperts):
    """``ExpertParallelExperts`` (same weights, names and ``("ep",)`` tags) with the two-level exchange.

    ``forward(xs, counts, weights, tokens)``: xs (M, C) this rank's routed rows sorted by global expert
    id, counts (E,), weights (M,) their routing weights, tokens (M,) int64 their token index ->
    (M, C): for each (token, node) pair the weighted sum of that node's experts' outputs on the pair's
    first row, zeros on its other rows (``MoE`` sums a token's rows without weighting again:
    ``weights_inside``). Collective over the ep group, also with M = 0. The per-node partial sums are
    rounded to the activation dtype before the final sum (flat dispatch rounds once)."""

    weights_inside = True
    accepts_side_fn = False

    def __init__(self, full: GroupedExperts, group: AxisGroup, groups: NodeGroups, tally=None):
        super().__init__(full, group, tally)
        self.groups, self.tally = groups, tally

    def forward(self, xs: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor | None = None,
                tokens: torch.Tensor | None = None):
        if weights is None or tokens is None:
            raise ValueError("hierarchical dispatch needs each row's routing weight and token (MoE passes them)")
        tally = self.tally if self.training else None  # the metric counts training steps, not evaluation
        return node_exchange(xs, counts, weights, tokens, self.groups, self._local, tally)

    def _local(self, x: torch.Tensor, counts: torch.Tensor, tally) -> torch.Tensor:
        return intra_exchange(x, counts, self.groups, lambda xr, c: GroupedExperts.forward(self, xr, c), tally)

    def extra_repr(self) -> str:
        g = self.groups
        return (f"{self.exchange.describe(self.w1.shape[0])}, hidden={self.w1.shape[1]}, dim={self.w1.shape[2]}, "
                f"dispatch / combine: hierarchical ({g.nodes} nodes x {g.per_node} ranks)")


def _exchange_sizes(send: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """send (P, K) int64 per destination -> (P, K) per source (an all-to-all of one row each)."""
    recv = torch.empty_like(send)
    all_to_all_v(recv, send.contiguous(), [1] * group.size, [1] * group.size, group)
    return recv


def node_exchange(xs: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor, tokens: torch.Tensor,
                  groups: NodeGroups, local_fn, tally) -> torch.Tensor:
    """The inter-node hop and the in-node weighted combine (module docstring, steps 1 and 3). Shapes
    as ``HierarchicalExperts.forward``; ``local_fn(rows, counts_in_node, tally)`` runs step 2."""
    nodes, per = groups.nodes, counts.numel() // groups.nodes  # per: experts held by one node
    m, c, dev = xs.shape[0], xs.shape[1], xs.device
    expert = torch.arange(counts.numel(), device=dev).repeat_interleave(counts)  # (M,) rows are expert-sorted
    node = expert // per  # (M,) destination node
    n_tok = int(tokens.max()) + 1 if m else 1
    pairs, row_pair = torch.unique(node * n_tok + tokens, sorted=True, return_inverse=True)  # (P,), (M,)
    first = torch.full((pairs.numel(),), m, dtype=torch.long, device=dev).scatter_reduce(
        0, row_pair, torch.arange(m, device=dev), "amin")  # (P,) first row of each pair
    send_p = torch.bincount(pairs // n_tok, minlength=nodes)  # (N,) pairs per node, in node order
    send_a = counts.view(nodes, per).sum(1)  # (N,) assignments per node
    recv = _exchange_sizes(torch.stack([send_p, send_a], 1), groups.inter_route)  # (N, 2) per source
    sp, sa, rp, ra = send_p.tolist(), send_a.tolist(), recv[:, 0].tolist(), recv[:, 1].tolist()
    xp = AllToAllV.apply(xs[first], rp, sp, groups.inter, tally)  # (P_in, C) one copy per (token, node)
    pair_off = torch.cumsum(send_p, 0) - send_p  # (N,)
    meta = torch.stack([expert - node * per, row_pair - pair_off[node]], 1)  # (M, 2) expert in node, pair in block
    meta_in = meta.new_empty((sum(ra), 2))
    all_to_all_v(meta_in, meta, ra, sa, groups.inter_route)
    w_in = AllToAllV.apply(weights.unsqueeze(1).contiguous(), ra, sa, groups.inter_route, None)[:, 0]  # (A_in,)
    src = torch.arange(nodes, device=dev).repeat_interleave(recv[:, 1])  # (A_in,) source node
    row_in = meta_in[:, 1] + (torch.cumsum(recv[:, 0], 0) - recv[:, 0])[src]  # (A_in,) row of xp
    perm = torch.argsort(meta_in[:, 0], stable=True)  # -> expert order inside the node
    y = local_fn(xp[row_in[perm]], torch.bincount(meta_in[:, 0], minlength=per), tally)  # (A_in, C)
    # weighted in the weights' float32; backward keeps y in the experts' dtype (moe_autograd)
    yw = weighted_sum(y.unsqueeze(1), w_in[perm].unsqueeze(1), y.dtype)  # (A_in, C)
    z = y.new_zeros(xp.shape[0], c).index_add(0, row_in[perm], yw)  # (P_in, C) summed inside the node
    back = AllToAllV.apply(z, sp, rp, groups.inter, tally)  # (P, C) one copy back per pair
    return scatter_rows(back.to(xs.dtype), first, m)


def intra_exchange(x: torch.Tensor, counts: torch.Tensor, groups: NodeGroups, experts_fn, tally) -> torch.Tensor:
    """Step 2: x (A, C) sorted by expert within the node, counts (per,) -> (A, C) the experts' outputs
    in x's order. The flat exchange over the node's ranks (``TokenExchange``), counts on ``ep_route``."""
    g = groups.per_node
    el = counts.numel() // g
    send = counts.view(g, el)  # (g, el): row r -> local rank r's experts
    recv = _exchange_sizes(send, groups.intra_route)  # (g, el): row s = rows from local rank s
    in_s, out_s = send.sum(1).tolist(), recv.sum(1).tolist()
    xr = AllToAllV.apply(x, out_s, in_s, groups.intra, tally)  # (R, C) in (source, expert) order
    seg = torch.arange(g * el, device=x.device).repeat_interleave(recv.reshape(-1))  # (R,) s * el + e
    perm = torch.argsort((seg % el) * g + seg // el, stable=True)  # -> (expert, source) order
    y = experts_fn(xr[perm], recv.sum(0))  # (R, C)
    y = scatter_rows(y, perm, y.shape[0])  # back to (source, expert) order
    return AllToAllV.apply(y, in_s, out_s, groups.intra, tally)
