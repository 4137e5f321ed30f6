"""Grouped GEMM (``torch._grouped_mm``) against the per-expert loop for the MoE expert matmuls.

    python bench/moe_grouped_gemm.py            # E = 4 / 16 / 64, M = 1024 / 4096 rows, fp32 + bf16
    python bench/moe_grouped_gemm.py --quick    # one size per dtype

One SwiGLU expert layer as ``ndtrain.model.moe.GroupedExperts`` runs it: M dispatched rows (tokens x
top-k, sorted by expert) of width C = 256 through E experts of hidden F = 256 (w1, w3: (E, F, C),
w2: (E, C, F)), the rows split over experts by a seeded multinomial draw (uneven, as routing is).
``fused``: ``grouped_mm(..., impl="fused")`` (one ``torch._grouped_mm`` call per weight);
``loop``: ``grouped_mm_loop`` (one matmul per expert segment, the slow twin). Timed: forward +
backward (gradients of the rows and all three weights), median over repeats, one thread, CPU.
Both are checked equal first (outputs and gradients: 1e-5 relative in fp32, 2e-2 in bf16). FLOP/s
counts 3 x 2 M C F x 3 (three matmuls, forward + two backward).

Writes ``bench/results/moe_grouped_gemm.json``. The machine's load is recorded with the result.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ndtrain.model.moe import grouped_mm
from ndtrain.tools.bench_utils import time_fn, write_result

C, FH = 256, 256


def swiglu_experts(xs, w1, w3, w2, counts, impl: str) -> torch.Tensor:
    """``GroupedExperts.forward`` with the implementation fixed: xs (M, C) -> (M, C)."""
    h = F.silu(grouped_mm(xs, w1, counts, impl)) * grouped_mm(xs, w3, counts, impl)  # (M, F)
    return grouped_mm(h, w2, counts, impl)


def make(e: int, m: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(e * 100003 + m)
    counts = torch.bincount(torch.randint(0, e, (m,), generator=g), minlength=e)  # (E,) rows per expert
    xs = torch.randn(m, C, generator=g).to(dtype).requires_grad_()
    ws = [(torch.randn(e, *shape, generator=g) * 0.05).to(dtype).requires_grad_()
          for shape in ((FH, C), (FH, C), (C, FH))]
    gout = torch.randn(m, C, generator=g).to(dtype)
    return counts, xs, ws, gout


def fwd_bwd(counts, xs, ws, gout, impl: str):
    y = swiglu_experts(xs, *ws, counts, impl)
    return (y, *torch.autograd.grad((y * gout).float().sum(), [xs, *ws]))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def measure(e: int, m: int, dtype: torch.dtype, repeats: int) -> dict:
    counts, xs, ws, gout = make(e, m, dtype)
    fused, loop = fwd_bwd(counts, xs, ws, gout, "fused"), fwd_bwd(counts, xs, ws, gout, "loop")
    err = max(_rel(a, b) for a, b in zip(fused, loop))
    assert err < (1e-5 if dtype == torch.float32 else 2e-2), (e, m, dtype, err)
    row = {"E": e, "M": m, "dtype": str(dtype).removeprefix("torch."), "max_rel_diff": err,
           "rows_per_expert_min_max": [int(counts.min()), int(counts.max())]}
    flops = 3 * 2 * m * C * FH * 3
    for impl in ("fused", "loop"):
        tm = time_fn(lambda impl=impl: fwd_bwd(counts, xs, ws, gout, impl), "cpu", warmup=1, repeats=repeats)
        row[impl] = {"median_s": tm.median_s, "min_s": tm.min_s, "gflop_per_s": flops / tm.median_s / 1e9}
    row["speedup_fused_vs_loop"] = row["loop"]["median_s"] / row["fused"]["median_s"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if not hasattr(torch, "_grouped_mm"):
        sys.exit("torch._grouped_mm is not available in this torch; nothing to compare")
    grid = [(8, 1024)] if args.quick else [(e, m) for e in (4, 16, 64) for m in (1024, 4096)]
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for e, m in grid:
            r = measure(e, m, dtype, 2 if args.quick else 3)
            rows.append(r)
            print(f"{r['dtype']:>8} E={e:>3} M={m:>5}: fused {r['fused']['median_s'] * 1e3:7.1f} ms "
                  f"({r['fused']['gflop_per_s']:5.1f} GFLOP/s), loop {r['loop']['median_s'] * 1e3:7.1f} ms "
                  f"({r['loop']['gflop_per_s']:5.1f} GFLOP/s), speedup {r['speedup_fused_vs_loop']:.2f}x, "
                  f"max rel diff {r['max_rel_diff']:.1e}")
    out = write_result(ROOT / "bench" / "results" / "moe_grouped_gemm.json",
                       {"C": C, "F": FH, "threads": 1, "rows": rows}, "cpu")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
