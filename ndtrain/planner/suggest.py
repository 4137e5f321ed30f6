"""When nothing fits or divides: the nearest GPU counts and global batch sizes with a layout
``ndtrain train`` accepts; and warnings for groups that are not aligned to the NVLink domain.

``nearest_gpus`` tries GPU counts near the asked one that are multiples of the node size times a
power of two (the counts that factor into tp x pp x dp with a power-of-two batch), nearest first;
``nearest_batches`` keeps the GPUs and rounds the batch (in sequences) to multiples of the
data-parallel degrees the meshes of that GPU count have. Each candidate runs the full search, so
what is suggested is what the search would recommend there. Pure Python.
"""
from __future__ import annotations

from dataclasses import replace

from ndtrain.planner.hardware import Cluster
from ndtrain.planner.layout import Layout, Workload
from ndtrain.planner.search import divisors, recommend, search


def _works(spec, cluster: Cluster, w: Workload) -> bool:
    return recommend(search(spec, cluster, w, top=0)) is not None


def nearest_gpus(spec, cluster: Cluster, w: Workload, want: int = 2, tries: int = 8) -> list[int]:
    """Up to ``want`` GPU counts near ``cluster.gpus`` (at most ``tries`` searched) where the search
    recommends a layout, nearest first."""
    n, gpn = cluster.gpus, cluster.gpus_per_node
    cands, step = set(), gpn
    while step <= 4 * n:
        cands.update(g for g in (n // step * step, -(-n // step) * step) if g > 0 and g != n)
        step *= 2
    found = []
    for g in sorted(cands, key=lambda g: (abs(g - n), g))[:tries]:
        if _works(spec, replace(cluster, gpus=g), w):
            found.append(g)
            if len(found) == want:
                break
    return found


def nearest_batches(spec, cluster: Cluster, w: Workload, want: int = 2, tries: int = 8) -> list[int]:
    """Up to ``want`` global batch sizes (sequences) near the asked one that a layout on these
    GPUs accepts and fits, nearest first: multiples of each mesh's data-parallel degree."""
    n, seqs = cluster.gpus, w.global_batch_seqs
    dps = {n // (tp * pp) for tp in divisors(n, cluster.gpus_per_node) for pp in divisors(n // tp, spec.n_layers)}
    cands = {b for dp in dps for b in (seqs // dp * dp, -(-seqs // dp) * dp) if b > 0 and b != seqs}
    found = []
    for b in sorted(cands, key=lambda b: (abs(b - seqs), b))[:tries]:
        if _works(spec, cluster, replace(w, global_batch_tokens=b * w.seq_len)):
            found.append(b)
            if len(found) == want:
                break
    return found


def suggestions(spec, cluster: Cluster, w: Workload) -> list[str]:
    """Lines naming the nearest GPU counts and batch sizes that work (empty when none is found)."""
    out = []
    gpus = nearest_gpus(spec, cluster, w)
    if gpus:
        out.append(f"nearest GPU counts with a valid layout that fits: {', '.join(f'{g:,}' for g in gpus)} "
                   f"(at {w.global_batch_seqs:,} sequences per step)")
    batches = nearest_batches(spec, cluster, w)
    if batches:
        out.append(f"on {cluster.gpus:,} GPUs, nearest global batches that work: "
                   + ", ".join(f"{b:,} sequences ({b * w.seq_len:,} tokens)" for b in batches))
    return out


def alignment_warnings(cluster: Cluster, lay: Layout | None = None) -> list[str]:
    """Warnings for GPUs or groups not aligned to the NVLink (fast-link) domain of
    ``cluster.gpus_per_node`` GPUs: a partial last domain, and (with ``lay``) an inner group
    tp x cp that does not divide the domain, so some of its groups straddle two domains and run
    over the NIC (the time model assumes they stay inside one)."""
    n, gpn, out = cluster.gpus, cluster.gpus_per_node, []
    if n % gpn:
        out.append(f"{n:,} GPUs is not a multiple of the {gpn}-GPU NVLink domain: {n // gpn} full "
                   f"domain{'s' if n // gpn != 1 else ''} and {n % gpn} GPU{'' if n % gpn == 1 else 's'} in a partial one")
    if lay is not None:
        span = lay.tp * lay.cp
        if 1 < span < gpn and gpn % span:
            out.append(f"tp x cp = {span} does not divide the {gpn}-GPU NVLink domain: some of its "
                       f"groups straddle two domains and cross the NIC (modelled as inside one)")
    return out
