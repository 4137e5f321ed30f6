"""Alpha-beta collective costs, the link each mesh axis lands on, and per-axis traffic of a layout.

Cost model (Hockney's alpha-beta; Thakur, Rabenseifner & Gropp 2005; Patarasuk & Yuan 2009 for the
bandwidth-optimal ring). V is the full tensor in bytes, n ranks, beta bytes/s per direction per
rank, alpha seconds per step:

    ring all-reduce        2(n-1)/n * V / beta + 2(n-1) alpha   (each rank moves 2(n-1)/n V)
    tree all-reduce        2 V / beta + 2 ceil(log2 n) alpha      (NCCL double binary tree)
    all-gather / reduce-scatter   (n-1)/n * V / beta + (n-1) alpha  (V = gathered size)
    all-to-all             (n-1)/n * V / beta + (n-1) alpha        (V = data one rank holds)
    send / recv            V / beta + alpha

NCCL picks the faster of ring and tree; so does ``estimate_collective_time``. The seed's example: a
16 GB gradient ring-all-reduced over 8 ranks moves 1.75 x 16 = 28 GB per rank: 31 ms at 900 GB/s,
0.56 s at 50 GB/s.

Links: axes are laid out outer to inner ``pp, dp_replicate, dp_shard, cp, tp`` (ndtrain's mesh);
a group of an axis spans stride x size consecutive ranks (``axis_spans``) and runs at the slowest
link it crosses (``Cluster.link``): inside a node NVLink, else the per-GPU NIC, else the pod uplink.
Inside a TPU slice (``Accelerator.torus_dims``) the group's rings run per torus dimension
(``torus.py``: two links per chip per dimension, not the chip's whole ICI bandwidth).
"""
from __future__ import annotations

import math

from ndtrain.planner.hardware import BANDWIDTH_EFFICIENCY, Cluster
from ndtrain.planner.layout import Layout, Workload
from ndtrain.planner.torus import group_dims, torus_collective_time, torus_shape


def ring_allreduce_bytes_per_rank(nbytes: float, n: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of ``nbytes``: 2(n-1)/n * V."""
    return 2.0 * (n - 1) / n * nbytes if n > 1 else 0.0


def estimate_collective_time(kind: str, nbytes: float, n: int, bytes_per_s: float,
                             latency_s: float = 0.0, efficiency: float = 1.0) -> float:
    """Seconds for one collective (see module docstring); 0 when n <= 1. Raises ValueError for an
    unknown kind (all_reduce, all_gather, reduce_scatter, all_to_all, send)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw = bytes_per_s * efficiency
    frac = (n - 1) / n
    steps = math.ceil(math.log2(n))
    if kind == "all_reduce":
        ring = 2 * frac * nbytes / bw + 2 * (n - 1) * latency_s
        tree = 2 * nbytes / bw + 2 * steps * latency_s
        return min(ring, tree)
    if kind in ("all_gather", "reduce_scatter"):
        return frac * nbytes / bw + min(n - 1, steps if n & (n - 1) == 0 else n - 1) * latency_s
    if kind == "all_to_all":
        return frac * nbytes / bw + (n - 1) * latency_s
    if kind == "send":
        return nbytes / bw + latency_s
    raise ValueError(f"unknown collective {kind!r}")


def axis_spans(lay: Layout) -> dict:
    """Consecutive ranks one group of each axis spans (stride x size), TP innermost."""
    tp, cp, ds, dr = lay.tp, lay.cp, lay.dp_shard, lay.dp_replicate
    return {"tp": tp, "cp": tp * cp, "ep": lay.etp * lay.ep, "dp_shard_cp": tp * cp * ds,
            "dp_replicate": tp * cp * ds * dr, "dp_cp": tp * cp * ds * dr, "pp": lay.world}


class Links:
    """Per-axis (name, bytes/s, latency) for a layout on a cluster, with the efficiency applied."""

    def __init__(self, cluster: Cluster, lay: Layout):
        self.cluster = cluster
        self.spans = axis_spans(lay)

    def name(self, axis: str) -> str:
        return self.cluster.link(self.spans[axis])[0]

    def time(self, kind: str, axis: str, nbytes: float, n: int) -> float:
        span = self.spans[axis]
        _, bw, lat = self.cluster.link(span)
        acc = self.cluster.accelerator
        if acc.torus_dims and span <= self.cluster.gpus_per_node and n > 1:  # inside a TPU slice
            shape = torus_shape(min(self.cluster.gpus, self.cluster.gpus_per_node), acc.torus_dims)
            link = bw / (2 * acc.torus_dims)  # per link per direction: 2 links per dimension
            return torus_collective_time(kind, nbytes, group_dims(span, n, shape), link, lat, BANDWIDTH_EFFICIENCY)
        return estimate_collective_time(kind, nbytes, n, bw, lat, BANDWIDTH_EFFICIENCY)


def estimate_axis_comm(spec, cluster: Cluster, w: Workload, lay: Layout, stage: dict) -> dict:
    """Collective seconds per axis for one rank of the bottleneck stage (before overlap).

    ``stage`` holds the stage's local parameter counts {"dense", "expert"} (after TP / EP split)
    and its block counts {"layers", "moe_layers"}. Per microbatch and per layer: ``tp_fwd``,
    ``tp_bwd`` (``cp_fwd``, ``cp_bwd``: 0 here, per mixer in ``mixer_comm``); per MoE layer: ``ep_fwd``, ``ep_bwd``; per microbatch per
    stage boundary: ``pp``; per microbatch for the stage: ``zero_fwd`` (ZeRO-3 all-gather) and
    ``zero_bwd`` (ZeRO-3 all-gather + reduce-scatter, ZeRO-2 reduce-scatter); per step:
    ``dp_grad`` (gradient reduction left after the last microbatch) and ``dp_param`` (all-gather
    of updated weights, ZeRO-1/2). Also ``links``: the link name of each axis in use.
    """
    L = Links(cluster, lay)
    e = w.act_bytes
    tokens = lay.microbatch * w.seq_len // lay.cp  # per rank per microbatch
    act = e * tokens * spec.dim  # one full (TP-gathered) residual-stream tensor
    out = dict.fromkeys(("tp_fwd", "tp_bwd", "cp_fwd", "cp_bwd", "ep_fwd", "ep_bwd", "pp",
                         "zero_fwd", "zero_bwd", "dp_grad", "dp_param"), 0.0)
    links = {}
    t = lay.tp
    if t > 1:  # Megatron TP (Shoeybi 2019), SP (Korthikanti 2022): 2 (attn + MLP) per direction
        links["tp"] = L.name("tp")
        if lay.seq_parallel:
            ag = L.time("all_gather", "tp", act, t)
            rs = L.time("reduce_scatter", "tp", act, t)
            out["tp_fwd"] = 2 * (ag + rs)
            out["tp_bwd"] = 2 * (ag + rs) + 2 * ag  # + re-gather of the sharded saved inputs
        else:
            ar = L.time("all_reduce", "tp", act, t)
            out["tp_fwd"] = out["tp_bwd"] = 2 * ar
    if lay.cp > 1:  # seconds per mixer kind: planner.mixer_comm (timing.py fills cp_fwd / cp_bwd)
        links["cp"] = L.name("cp")
    if lay.ep > 1 and stage["moe_layers"]:  # GShard / Switch: dispatch + combine all-to-all
        links["ep"] = L.name("ep")
        # folded: the tp group's tokens split over its tp / expert_tp expert-TP groups (fewest bytes)
        share = lay.etp / t if lay.folded else 1 / (t if lay.seq_parallel else 1)
        a2a = moe_all_to_all(spec, cluster, w, lay, tokens * share)
        out.update({k: v for k, v in a2a.items() if k.startswith("ep_")})
    if lay.pp > 1:
        links["pp"] = L.name("pp")
        out["pp"] = L.time("send", "pp", act / (t if lay.seq_parallel else 1), 2)
    pb, gb = _param_grad_bytes(w.precision)
    n_sh = lay.dp_shard * lay.cp
    dense, expert = stage["dense"], stage["expert"]
    z = lay.zero_stage

    def shard(kind, nbytes_dense, nbytes_expert):
        tm = L.time(kind, "dp_shard_cp", nbytes_dense, n_sh)
        return tm + L.time(kind, "dp_shard_cp", nbytes_expert, lay.expert_dp if lay.folded else max(1, n_sh // lay.ep))

    if lay.dp * lay.cp > 1:
        links["dp"] = L.name("dp_shard_cp") if n_sh > 1 else L.name("dp_replicate")
        if z == 0:
            out["dp_grad"] = L.time("all_reduce", "dp_cp", gb * dense, lay.dp * lay.cp) + \
                L.time("all_reduce", "dp_cp", gb * expert, lay.expert_dp)
        else:
            rep = L.time("all_reduce", "dp_replicate", gb * (dense + expert) / n_sh, lay.dp_replicate)
            rs = shard("reduce_scatter", gb * dense, gb * expert)
            ag = shard("all_gather", pb * dense, pb * expert)
            if z == 1:
                out["dp_grad"], out["dp_param"] = rs + rep, ag
            elif z == 2:  # each bucket reduce-scattered as backward produces it
                out["zero_bwd"], out["dp_grad"], out["dp_param"] = rs, rep, ag
            else:  # FSDP: gather for forward, again for backward, reduce-scatter gradients
                out["zero_fwd"], out["zero_bwd"], out["dp_grad"] = ag, ag + rs, rep
    out["links"] = links
    return out


def remote_nodes_per_token(spec, n_nodes: int, max_nodes: int = 0) -> float:
    """Expected remote nodes one token's top-k experts touch on an ep group over ``n_nodes`` nodes
    (E / N experts each, uniform routing): node-limited (M > 0) min(M, k, N) nodes uniformly, so
    M' (N - 1) / N remote; else each remote node is missed by all k picks (without replacement)
    with probability C(E - E/N, k) / C(E, k)."""
    if n_nodes <= 1:
        return 0.0
    k, E = spec.top_k, spec.n_experts
    if max_nodes:
        return min(max_nodes, k, n_nodes) * (n_nodes - 1) / n_nodes
    per = E // n_nodes
    return (n_nodes - 1) * (1 - math.comb(E - per, k) / math.comb(E, k))


def moe_all_to_all(spec, cluster: Cluster, w: Workload, lay: Layout, tokens: float) -> dict:
    """Expert dispatch + combine of one MoE layer for one microbatch of ``tokens`` tokens on one
    rank (GShard, Lepikhin 2020; DeepSeek-V3 report 2024, sections 3.2.2 and 3.3). Per token
    top-k copies of width h go out (dispatch) and come back (combine).

    * Split by link: the ep group of ``ep`` ranks (stride: the experts' tp, ``Layout.etp``) has
      ``g = min(ep, gpus_per_node / etp)`` ranks on each node and spans ``N = ep / g`` nodes.
    * ``moe_dispatch=flat``: every routed copy travels on its own. Uniform routing sends a copy to
      a rank of this node with probability g / ep (1 / ep of it stays on this rank) and across
      nodes with (ep - g) / ep: inter = s k h b (ep - g) / ep, intra = s k h b (g - 1) / ep bytes
      (node-limited routing does not change these expectations).
    * ``moe_dispatch=hierarchical``: a token crosses the NIC once per remote node it reaches (to
      the rank with the same local index, which forwards over NVLink): inter = s h b R with R
      the expected remote nodes (``remote_nodes_per_token``; with ``moe_max_nodes`` M, DeepSeek-V3
      uses 4: M' (N - 1) / N), intra = s k h b (g - 1) / g (its own copies and the forwarded ones).
    * fp8 dispatch (``moe_fp8_dispatch``): dispatch b = 1 byte + one fp32 scale per 128 values;
      combine and both backward all-to-alls stay bf16 (as DeepSeek-V3).
    * The NVLink and the NIC parts run at the same time, each at its own (bottleneck) bandwidth:
      a pass takes the longer of the two, then the busiest rank's share: x ``moe_imbalance``.
    * Overlap: with shared experts the dispatch / combine overlaps with the shared expert's GEMMs
      on the local tokens (DeepSeek-V3's shared-expert overlap; ``moe_shared_overlap=0``: not); under ``dualpipev`` a microbatch's
      all-to-all overlaps with the other microbatch's whole layer (attention + experts); both at
      ``COMPUTE_EFFICIENCY`` (or ``--efficiency``) x the 16-bit peak. The excess is exposed.

    Returns seconds per MoE layer ``ep_fwd`` / ``ep_bwd`` (exposed) and ``ep_fwd_raw`` /
    ``ep_bwd_raw``, and the forward bytes per rank ``ep_inter_bytes`` / ``ep_intra_bytes``.
    """
    from ndtrain.planner.hardware import COMPUTE_EFFICIENCY

    h, k, ep = spec.dim, spec.top_k, lay.ep
    g = max(1, min(ep, cluster.gpus_per_node // lay.etp))
    n_nodes = -(-ep // g)
    b_disp = 1 + 4 / 128 if w.moe_fp8_dispatch else w.act_bytes

    def volume(b: float) -> tuple[float, float]:
        if lay.moe_dispatch == "hierarchical" and n_nodes > 1:
            return tokens * h * b * remote_nodes_per_token(spec, n_nodes, w.moe_max_nodes), tokens * k * h * b * (g - 1) / g
        return tokens * k * h * b * (ep - g) / ep, tokens * k * h * b * (g - 1) / ep

    _, bw_in, lat_in = cluster.link(1)
    _, bw_out, lat_out = cluster.link(cluster.gpus_per_node + 1) if n_nodes > 1 else ("", 1.0, 0.0)

    def seconds(b: float) -> float:
        inter, intra = volume(b)
        t_in = intra / (bw_in * BANDWIDTH_EFFICIENCY) + (g - 1) * lat_in
        t_out = inter / (bw_out * BANDWIDTH_EFFICIENCY) + (n_nodes - 1) * lat_out if inter else 0.0
        return max(t_in, t_out) * max(1.0, w.moe_imbalance)

    fwd = seconds(b_disp) + seconds(w.act_bytes)
    bwd = 2 * seconds(w.act_bytes)
    eff = getattr(cluster.accelerator, "compute_efficiency", 0.0) or COMPUTE_EFFICIENCY
    rate = cluster.mfu_peak_flops_per_s * eff
    overlap = lay.moe_shared_overlap != 0  # -1: wherever there are shared experts
    shared = 2 * tokens * 3 * h * spec.shared_ffn_hidden * spec.n_shared_experts / lay.tp * overlap
    hide_f, hide_b = shared / rate, 2 * shared / rate
    if lay.pp_schedule == "dualpipev":  # the other microbatch's layer: attention + active experts
        layer = 2 * tokens * spec.layer_params(True, active=True) / lay.tp
        layer += tokens * spec.attention_flops_per_layer(w.seq_len) / 6 / lay.tp
        hide_f, hide_b = layer / rate, 2 * layer / rate
    inter, intra = volume(b_disp)
    ic, nc = volume(w.act_bytes)
    return {"ep_fwd": max(0.0, fwd - hide_f), "ep_bwd": max(0.0, bwd - hide_b), "ep_fwd_raw": fwd,
            "ep_bwd_raw": bwd, "ep_inter_bytes": inter + ic, "ep_intra_bytes": intra + nc}


def _param_grad_bytes(precision: str) -> tuple[int, int]:
    """Bytes per element of the weights gathered and gradients reduced (compute-dtype copies)."""
    from ndtrain.planner.memory import PRECISIONS

    p, g, _ = PRECISIONS[precision]
    return p, g
