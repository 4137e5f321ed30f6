"""Context parallel attention at equal cp: ring vs Ulysses vs hybrid (Ulysses inside, ring across).

    python bench/cp_hybrid.py                    # cp = 4, hybrid 2 x 2, T = 1024 / 4096 (gloo, CPU)
    python bench/cp_hybrid.py --lengths 2048 --repeats 5
    python bench/cp_hybrid.py --quick            # T = 512, 2 repeats

One causal softmax attention core (the cp cores ``apply_cp`` installs: ``RingAttention``,
``UlyssesAttention`` around causal SDPA, ``HybridAttention``) on B = 1, H = 8 query heads, G = 2 kv
heads, D = 64, float32, every rank holding T / cp tokens (load-balanced layout for ring and hybrid,
contiguous for Ulysses). Before timing, each is checked against causal SDPA on the whole sequence
(float64, T = 64: output and q / k / v gradients to 1e-10). Measured: bytes one rank sends per axis
for one forward + backward (``cp`` for ring / Ulysses, ``cp_a2a`` and ``cp_ring`` for hybrid,
asserted equal to the closed forms), and the median / minimum wall time of forward + backward (a
barrier before and after; the forms alternate call by call). Ratios are to ring in the same run.
On CPU gloo with every rank on one machine, "inside" and "across" a node cost the same, so the time
shows compute and message counts, not the cross-node saving (the bytes per axis show that).
Writes ``bench/results/cp_hybrid.json``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ndtrain.mesh import ParallelDims
from ndtrain.parallel.cp.context_parallel import (
    LayoutPositions,
    RingAttention,
    UlyssesAttention,
    shard_sequence,
)
from ndtrain.parallel.cp.hybrid import HybridAttention, build_subgroups, hybrid_bytes
from ndtrain.spawn import spawn
from ndtrain.tools.bench_utils import write_result

B, H, G, D, CP, U = 1, 8, 2, 64, 4, 2
LAYOUT = {"ring": "load_balanced", "ulysses": "contiguous", "hybrid": "load_balanced"}


def causal(q, k, v, documents=None):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def cores(mesh) -> dict:
    cp = mesh.group("cp")
    inner, outer = build_subgroups(mesh, U)
    return {"ring": RingAttention(cp, "load_balanced"), "ulysses": UlyssesAttention(cp, causal),
            "hybrid": HybridAttention(cp, inner, outer, LayoutPositions("load_balanced"))}


def theory(name: str, t: int) -> dict[str, float]:
    """Closed-form bytes per rank, forward + backward, float32."""
    s = B * (t // CP) * D * 4
    if name == "ring":  # (cp-1) K/V forward, (cp-1) K/V + cp dK/dV backward, each 2 G S
        return {"cp": (3 * CP - 2) * 2 * G * s}
    if name == "ulysses":  # G (2) < cp (4): kv repeated to H first; q, k, v, out both ways
        return {"cp": 2 * (CP - 1) / CP * 4 * H * s}
    return hybrid_bytes(B, t // CP, H, G, D, U, CP // U, 4)


def inputs(t: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, n, t, D, generator=g, dtype=dtype) for n in (H, G, G)]


def check(fns: dict, cp) -> dict[str, float]:
    """Worst relative error of each core (output, q / k / v grads) against whole-sequence causal SDPA."""
    t = 64
    full = [x.requires_grad_() for x in inputs(t, torch.float64)]
    gout = torch.randn(B, H, t, D, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    ref = causal(*full)
    grads = torch.autograd.grad((ref * gout).sum(), full)
    out = {}
    for name, fn in fns.items():
        lay = LAYOUT[name]
        local = [shard_sequence(x.detach(), cp.size, cp.rank, lay, dim=2).requires_grad_() for x in full]
        o = fn(*local)
        gl = torch.autograd.grad((o * shard_sequence(gout, cp.size, cp.rank, lay, dim=2)).sum(), local)
        want = [ref] + list(grads)
        errs = [((a - shard_sequence(b.detach(), cp.size, cp.rank, lay, dim=2)).abs().max() / b.abs().max()).item()
                for a, b in zip([o, *gl], want)]
        out[name] = max(errs)
    return out


def _rank(rank: int, world: int, lengths: list[int], repeats: int) -> dict:
    mesh = ParallelDims(cp=world, world_size=world).build_mesh()
    cp = mesh.group("cp")
    fns = cores(mesh)
    errs = check(fns, cp)
    rows = []
    for t in lengths:
        full = inputs(t, torch.float32)
        local = {n: [shard_sequence(x, CP, cp.rank, LAYOUT[n], dim=2).requires_grad_() for x in full] for n in fns}
        gout = torch.randn(B, H, t // CP, D)

        def step(name: str, local=local, gout=gout) -> float:
            dist.barrier()
            t0 = time.perf_counter()
            torch.autograd.grad((fns[name](*local[name]) * gout).sum(), local[name])
            dist.barrier()
            return time.perf_counter() - t0

        row = {"T": t}
        for name in fns:  # untimed warm-up counts the bytes
            mesh.reset_stats()
            step(name)
            sent = mesh.reset_stats()
            assert sent == theory(name, t), (name, sent, theory(name, t))
            row[name] = {"bytes_per_axis": sent, "bytes_total": sum(sent.values()), "times_s": []}
        for _ in range(repeats):
            for name in fns:
                row[name]["times_s"].append(step(name))
        for name in fns:
            ts = row[name]["times_s"]
            row[name].update(median_s=statistics.median(ts), min_s=min(ts))
        rows.append(row)
    return {"err_fp64": errs, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    lengths, repeats = ([512], 2) if args.quick else (args.lengths, args.repeats)
    t0 = time.perf_counter()
    res = spawn(_rank, CP, (lengths, repeats), backend="gloo", threads=1, timeout_s=1800)
    errs = {n: max(r["err_fp64"][n] for r in res) for n in res[0]["err_fp64"]}
    assert max(errs.values()) < 1e-10, errs
    rows = res[0]["rows"]
    for row in rows:
        ring = row["ring"]
        for name in ("ring", "ulysses", "hybrid"):
            r = row[name]
            r["ratio_vs_ring"] = {"min_s": r["min_s"] / ring["min_s"], "median_s": r["median_s"] / ring["median_s"],
                                  "bytes_total": r["bytes_total"] / ring["bytes_total"]}
            axes = ", ".join(f"{a} {v / 1e6:.2f} MB" for a, v in sorted(r["bytes_per_axis"].items()))
            print(f"T={row['T']:>6} {name:>8}: {axes} | min {r['min_s'] * 1e3:8.1f} ms "
                  f"(x{r['ratio_vs_ring']['min_s']:.2f} ring), median {r['median_s'] * 1e3:8.1f} ms")
    out = write_result(ROOT / "bench" / "results" / "cp_hybrid.json",
                       {"B": B, "H": H, "G": G, "D": D, "cp": CP, "cp_ulysses": U, "dtype": "float32",
                        "lengths": lengths, "repeats": repeats, "err_fp64": errs, "rows": rows,
                        "wall_s": time.perf_counter() - t0}, "cpu")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
