"""Attention activation memory per rank against sequence length under context parallel.

    python bench/cp_memory.py            # cp = 1, 2, 4 (gloo processes), T = 512 .. 4096

For each cp degree and sequence length T, every rank runs ring attention (``ndtrain.parallel.cp.ring``,
load-balanced causal layout) forward + backward on its T / cp tokens (B=1, H=8 query heads, G=2 kv
heads, D=64, float32) and reports:

* ``saved_bytes``: bytes autograd keeps for backward (q, k, v, out, lse), measured with
  ``torch.autograd.graph.saved_tensors_hooks``; expected to scale as 1/cp;
* ``block_scores_bytes``: the largest transient of the blockwise kernel, one (B, H, T/cp, T/cp)
  fp32 score block (from the shapes; the ring never materialises the T x T matrix);
* ``fwd_bwd_s``: wall time of forward + backward on this rank (CPU, informational);
* baseline in the same command: the model's own core (``F.scaled_dot_product_attention``, causal,
  one process, whole sequence) and its saved bytes.

Ratios are against cp = 1. Writes ``bench/results/cp_memory.json`` and ``docs/cp_memory.png``.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ndtrain.mesh import ParallelDims
from ndtrain.model.attention import causal_attention
from ndtrain.parallel.cp.context_parallel import local_positions, shard_sequence
from ndtrain.parallel.cp.ring import ring_attention
from ndtrain.spawn import spawn

B, H, G, D = 1, 8, 2, 64
SEQ = (512, 1024, 2048, 4096)


def _inputs(t: int):
    g = torch.Generator().manual_seed(t)
    q = torch.randn(B, H, t, D, generator=g)
    k, v = torch.randn(B, G, t, D, generator=g), torch.randn(B, G, t, D, generator=g)
    return q, k, v, torch.randn(B, H, t, D, generator=g)


def _saved_bytes(fn) -> tuple[torch.Tensor, int]:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total


def measure_ring(rank: int, cp: int) -> list[dict]:
    mesh = ParallelDims(cp=cp, world_size=cp).build_mesh()
    group = mesh.group("cp")
    rows = []
    for t in SEQ:
        q, k, v, dout = _inputs(t)
        pos = torch.stack([local_positions(t, cp, r, "load_balanced") for r in range(cp)])
        ql, kl, vl = (shard_sequence(x, cp, rank, "load_balanced", 2).requires_grad_() for x in (q, k, v))
        t0 = time.perf_counter()
        out, saved = _saved_bytes(lambda: ring_attention(ql, kl, vl, group, pos[rank], pos, causal=True))
        out.backward(shard_sequence(dout, cp, rank, "load_balanced", 2))
        dt = time.perf_counter() - t0
        tl = t // cp
        rows.append({"cp": cp, "T": t, "rank": rank, "saved_bytes": saved, "block_scores_bytes": B * H * tl * tl * 4,
                     "fwd_bwd_s": dt, "cp_bytes_sent": mesh.reset_stats().get("cp", 0.0)})
    return rows


def measure_sdpa() -> list[dict]:
    rows = []
    for t in SEQ:
        q, k, v, dout = _inputs(t)
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        t0 = time.perf_counter()
        out, saved = _saved_bytes(lambda: causal_attention(q, k, v))
        out.backward(dout)
        rows.append({"T": t, "saved_bytes": saved, "fwd_bwd_s": time.perf_counter() - t0})
    return rows


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(9, 3.4))
    for cp in (1, 2, 4):
        rows = sorted((r for r in results["ring"] if r["cp"] == cp and r["rank"] == 0), key=lambda r: r["T"])
        ts = [r["T"] for r in rows]
        ax[0].plot(ts, [r["saved_bytes"] / 2**20 for r in rows], "o-", label=f"cp={cp}")
        ax[1].plot(ts, [r["block_scores_bytes"] / 2**20 for r in rows], "o-", label=f"cp={cp}")
    for a, title in zip(ax, ("saved for backward (measured)", "largest score block (from shapes)")):
        a.set_xscale("log", base=2)
        a.set_yscale("log", base=2)
        a.set_xlabel("sequence length T")
        a.set_ylabel("MiB per rank")
        a.set_title(title, fontsize=10)
        a.legend()
    fig.suptitle("Ring attention memory per rank (B=1, H=8, G=2, D=64, fp32)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    results = {"config": {"B": B, "H": H, "G": G, "D": D, "dtype": "float32", "layout": "load_balanced"},
               "sdpa_one_process": measure_sdpa(), "ring": []}
    results["ring"] += measure_ring(0, 1)
    for cp in (2, 4):  # measure_ring(rank, cp) on cp gloo ranks
        for rows in spawn(measure_ring, cp, backend="gloo", threads=max(1, (os.cpu_count() or 1) // cp)):
            results["ring"] += rows
    base = {row["T"]: row for row in results["ring"] if row["cp"] == 1}
    print(f"{'T':>6} {'cp':>3} {'saved MiB/rank':>15} {'vs cp=1':>8} {'score block MiB':>16} {'fwd+bwd s':>10}")
    for row in results["ring"]:
        row["saved_ratio_vs_cp1"] = row["saved_bytes"] / base[row["T"]]["saved_bytes"]
    for row in sorted(results["ring"], key=lambda r: (r["T"], r["cp"], r["rank"])):
        if row["rank"] == 0:
            print(f"{row['T']:>6} {row['cp']:>3} {row['saved_bytes'] / 2**20:>15.2f} {row['saved_ratio_vs_cp1']:>8.3f}"
                  f" {row['block_scores_bytes'] / 2**20:>16.1f} {row['fwd_bwd_s']:>10.3f}")
    for row in results["sdpa_one_process"]:
        print(f"SDPA core, one process, T={row['T']}: saved {row['saved_bytes'] / 2**20:.2f} MiB, "
              f"fwd+bwd {row['fwd_bwd_s']:.3f} s")
    plot(results, ROOT / "docs" / "cp_memory.png")
    dest = ROOT / "bench" / "results" / "cp_memory.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(results, indent=1))
    print(f"wrote {dest}")


if __name__ == "__main__":
    main()
