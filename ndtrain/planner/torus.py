"""Collectives on a TPU 3-D torus (TPU v4 / v5p ICI) against a switched fabric.

A TPU slice is a 3-D torus (Jouppi et al. 2023, "TPU v4", section 2): each chip has two links per
dimension (one to each neighbour, wrap-around included), so a ring along one dimension can run in
both directions at once and uses ``2 x link`` bytes/s per chip, while a switched GPU fabric gives
every group the device's whole injection bandwidth. The seed lecture's section 8.4 draws the same
contrast: point-to-point neighbours suit the regular rings of tensor / data parallel, and make
all-to-all costly.

Costs (alpha-beta, per dimension i of the group, n_i chips along it, link bytes/s per direction,
``share`` strided rings sharing the same links):

    all-reduce      sum_i 2 (n_i - 1) / n_i * V_i / (2 link / share_i) + 2 (n_i - 1) alpha
    all-gather / reduce-scatter: half of that
    all-to-all      sum_i V * sum_j min(j, n_i - j) / (2 n_i link / share_i) + (n_i - 1) alpha
    send            V / link + alpha   (neighbours)

with V_1 = V and V_{i+1} = V_i / n_i: the dimension-ordered algorithm reduce-scatters along one
dimension, then the next on the shard it kept, and all-gathers back in reverse (the bandwidth-
optimal schedule on a torus; a ring all-reduce over one axis of size n moves 2(n-1)/n of its data
over that dimension's links). The all-to-all term is a bidirectional ring's hop-bytes (each chip
sends V/n to every other, min(j, n-j) hops away) over its 2n link directions.

Ranks fill the torus x first, then y, then z (``torus_shape``); a mesh axis whose group spans
``span`` consecutive ranks with ``n`` members (stride span / n) covers the dimensions
``group_dims`` returns.
"""
from __future__ import annotations

# Overlap of TP inside a slice: XLA's SPMD partitioner decomposes a TP all-gather / reduce-scatter
# into per-neighbour steps along the ring and runs each step under the partial matmul it feeds
# ("collective matmul": Wang et al. 2023, "Overlap Communication with Dependent Computation via
# Decomposition in Large Deep Learning Models"; the torus's neighbour links are what make the steps
# cheap), so forward TP collectives hide behind the layer's forward GEMMs and backward ones behind
# all of its backward GEMMs. A switched GPU fabric runs them exposed forward (timing.py).


def in_slice_tp(cluster, lay) -> bool:
    """True when the layout's TP groups lie inside one TPU torus slice (the overlap above applies)."""
    acc = cluster.accelerator
    return bool(acc.torus_dims) and lay.tp > 1 and lay.tp <= cluster.gpus_per_node


def torus_tp_exposed(tp_fwd: float, tp_bwd: float, gemm_fwd: float, gemm_bwd: float) -> tuple[float, float]:
    """(forward, backward) exposed seconds of one layer's TP collectives inside a slice: what the
    layer's forward / backward GEMMs (seconds) do not cover."""
    return max(0.0, tp_fwd - gemm_fwd), max(0.0, tp_bwd - gemm_bwd)


def torus_shape(chips: int, n_dims: int = 3) -> tuple:
    """A torus shape for ``chips`` chips: prime factors, largest first, each multiplied into the
    smallest dimension (64 -> 4x4x4, 512 -> 8x8x8, 4096 -> 16x16x16, 6144 -> 16x16x24)."""
    if chips < 1:
        raise ValueError(f"chips ({chips}) must be >= 1")
    primes, n, f = [], chips, 2
    while n > 1:
        while n % f == 0:
            primes.append(f)
            n //= f
        f += 1
    dims = [1] * n_dims
    for q in sorted(primes, reverse=True):
        i = min(range(n_dims), key=lambda j: (dims[j], j))
        dims[i] *= q
    return tuple(sorted(dims))


def group_dims(span: int, n: int, shape: tuple) -> list[tuple[int, int]]:
    """(members along the dimension, strided rings sharing its links) for each torus dimension a
    group of ``n`` ranks spread evenly over ``span`` consecutive ranks covers (x fastest)."""
    stride, left, out = max(1, span // max(n, 1)), n, []
    for d in shape:
        if left <= 1:
            break
        if stride >= d:  # the stride steps over this whole dimension
            stride //= d
            continue
        k = min(left, max(1, d // stride))
        out.append((k, stride))
        stride, left = 1, max(1, left // k)
    return out


def torus_collective_time(kind: str, nbytes: float, dims: list[tuple[int, int]], link_bytes_per_s: float,
                          latency_s: float = 0.0, efficiency: float = 1.0) -> float:
    """Seconds for one collective over a torus group (``group_dims``); see the module docstring.
    Raises ValueError for an unknown kind."""
    bw = link_bytes_per_s * efficiency
    t, v = 0.0, float(nbytes)
    if kind == "send":
        return nbytes / bw + latency_s if dims else 0.0
    for n, share in dims:
        if n <= 1:
            continue
        ring = 2 * bw / share  # both directions of the dimension's ring
        if kind == "all_reduce":
            t += 2 * (n - 1) / n * v / ring + 2 * (n - 1) * latency_s
        elif kind in ("all_gather", "reduce_scatter"):
            t += (n - 1) / n * v / ring + (n - 1) * latency_s
        elif kind == "all_to_all":
            hops = sum(min(j, n - j) for j in range(1, n))
            t += nbytes * hops / (n * ring) + (n - 1) * latency_s
            continue
        else:
            raise ValueError(f"unknown collective {kind!r}")
        v /= n
    return t
