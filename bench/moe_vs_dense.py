"""Training tokens/s of a small MoE against a dense model with the same active parameters.

    python bench/moe_vs_dense.py [--steps 12]

Dense: SwiGLU hidden F = k * F_e. MoE: E = 8 experts of hidden F_e, top-k = 2, so a token's FFN
matmuls touch the same parameters (plus the router, E * C). Total FFN parameters are E / k = 4x
the dense ones. Both train with the ndtrain Trainer (one process, float32, same batches); steps
alternate dense, MoE-fused, MoE-loop, ... so machine noise hits all equally; medians are reported
with ratios to dense. "fused" = ``torch._grouped_mm``, "loop" = one matmul per expert (the slow
twin). The MoE step also pays for routing, sorting, gathering and the scatter back.
Writes ``bench/results/moe_vs_dense.json``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ndtrain.config import Config, DataConfig, ModelConfig, TrainingConfig
from ndtrain.mesh import ParallelDims
from ndtrain.model.moe import moe_layers
from ndtrain.train.loop import Trainer
from ndtrain.train.metrics import flops_per_token

C, L, FE, E, K, B, T = 256, 4, 256, 8, 2, 8, 128


def make(moe: bool, impl: str = "auto") -> Trainer:
    extra = dict(moe_experts=E, moe_top_k=K, moe_ffn_hidden=FE) if moe else {}
    m = ModelConfig(vocab_size=2048, dim=C, n_layers=L, n_heads=8, ffn_hidden=K * FE, max_seq_len=T, **extra)
    cfg = Config(model=m, data=DataConfig(seq_len=T),
                 training=TrainingConfig(dtype="float32", global_batch_size=B, lr=1e-3, warmup_steps=0))
    tr = Trainer(cfg, ParallelDims(world_size=1).build_mesh(), torch.device("cpu"))
    for layer in moe_layers(tr.model):
        layer.experts.impl = impl
    return tr


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    runs = {"dense": make(False), "moe_fused": make(True, "fused" if hasattr(torch, "_grouped_mm") else "loop"),
            "moe_loop": make(True, "loop")}
    times = {k: [] for k in runs}
    for step in range(args.steps + 2):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, 2048, (B, T), generator=g)
        for name, tr in runs.items():
            t0 = time.perf_counter()
            tr.step(x, torch.roll(x, -1, 1))
            if step >= 2:  # warm-up
                times[name].append(time.perf_counter() - t0)
    res = {"threads": torch.get_num_threads(), "tokens_per_step": B * T}
    for name, ts in times.items():
        med = statistics.median(ts)
        tr = runs[name]
        act = sum(p.numel() for p in tr.model.parameters())
        res[name] = {"median_step_s": med, "tokens_per_s": B * T / med, "params_total": act,
                     "flops_per_token": flops_per_token(tr.cfg.model, T)}
    for name in ("moe_fused", "moe_loop"):
        res[name]["tokens_per_s_vs_dense"] = res[name]["tokens_per_s"] / res["dense"]["tokens_per_s"]
    for name in runs:
        r = res[name]
        print(f"{name:9s}: {r['tokens_per_s']:8.0f} tok/s | {r['params_total'] / 1e6:.2f}M params | "
              f"{r['flops_per_token'] / 1e6:.1f} MFLOP/token"
              + (f" | {r['tokens_per_s_vs_dense']:.2f}x dense" if name != "dense" else ""))
    out = ROOT / "bench" / "results" / "moe_vs_dense.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
