"""Where ndtrain's eager step and the plain PyTorch loop of ``bench/eager_vs_plain.py`` spend time,
op by op, in one process.

    python bench/eager_profile.py [--steps 6] [--threads 1] [--top 30]

Each measured step runs under its own ``torch.profiler`` session (CPU activity); the two sides
alternate (the order flips each step) on the same batches, so load on a shared machine hits both
alike. Per op: self time in ms per step (the profiler's wall time inside the op, which on a loaded
machine includes time the thread waited for a core) and calls per step; per side: the process CPU
time of each step (``time.process_time``, all threads). Writes ``bench/results/eager_profile.json``.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import eager_vs_plain as E


def _sides():
    from ndtrain.mesh import ParallelDims
    from ndtrain.train.trainer import Trainer

    cfg = E.ndtrain_cfg(1, False)
    tr = Trainer(cfg, ParallelDims.from_config(cfg.parallel, 1).build_mesh(), torch.device("cpu"))
    torch.manual_seed(0)
    model = E.PlainLlama()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95), foreach=True)
    return {"ndtrain": lambda x, y: tr.step(x, y), "plain": lambda x, y: E.plain_step(model, model, opt, x, y)}


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    seq = torch.randint(0, E.VOCAB, (E.B, E.T + 1), generator=torch.Generator().manual_seed(step))
    return seq[:, :-1], seq[:, 1:]


def run(steps: int, warmup: int = 2) -> dict:
    """Per side: ``cpu_s`` (median process CPU seconds per step), ``ops`` {name: [ms, calls] per step}."""
    fns = _sides()
    for s in range(warmup):
        for f in fns.values():
            f(*_batch(s))
    ops = {k: collections.defaultdict(lambda: [0.0, 0.0]) for k in fns}
    cpu = {k: [] for k in fns}
    for s in range(steps):
        x, y = _batch(100 + s)
        for name in ("ndtrain", "plain") if s % 2 == 0 else ("plain", "ndtrain"):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t0 = time.process_time()
                fns[name](x, y)
                cpu[name].append(time.process_time() - t0)
            for e in prof.key_averages():
                acc = ops[name][e.key]
                acc[0] += e.self_cpu_time_total / 1e3 / steps
                acc[1] += e.count / steps
    return {k: {"cpu_s": statistics.median(cpu[k]), "ops": dict(ops[k])} for k in fns}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    res = run(args.steps)
    nd, pl = res["ndtrain"]["ops"], res["plain"]["ops"]
    keys = sorted(set(nd) | set(pl), key=lambda k: -(nd.get(k, [0, 0])[0] + pl.get(k, [0, 0])[0]))[:args.top]
    print(f"{'op':58s} {'ndtrain ms':>10s} {'plain ms':>9s} {'calls':>6s} {'calls':>6s}")
    for k in keys:
        a, b = nd.get(k, [0.0, 0.0]), pl.get(k, [0.0, 0.0])
        print(f"{k[:58]:58s} {a[0]:10.1f} {b[0]:9.1f} {a[1]:6.0f} {b[1]:6.0f}")
    print(f"CPU s / step: ndtrain {res['ndtrain']['cpu_s']:.3f}, plain {res['plain']['cpu_s']:.3f}")
    out = {"threads": args.threads, "steps": args.steps, "load_before": load_before, "load_after": os.getloadavg(),
           "cpu_s_per_step": {k: v["cpu_s"] for k, v in res.items()},
           "top_ops_ms_calls_per_step": {k: {"ndtrain": nd.get(k), "plain": pl.get(k)} for k in keys}}
    path = ROOT / "bench" / "results" / "eager_profile.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
