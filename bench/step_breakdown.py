"""Where a training step's time goes: forward, backward, optimizer, communication waits, bookkeeping.

    python bench/step_breakdown.py [--steps 8] [--warmup 3] [--layouts single,pp2] [--out step_breakdown.json]

``Trainer.step`` of the reference model (dim 256, 8 layers, 8 heads, vocab 8192, 8 sequences x 256
tokens per data-parallel rank, bf16 autocast, AdamW) split into phases by
``ndtrain.train.profiling.StepBreakdown`` (wall-clock spans; the waits of the counted primitives),
for one process and for pp = 2 (1F1B, two microbatches, two gloo processes). Threads follow
``ndtrain.spawn.thread_policy``. Reports the median of each phase over the timed steps (per rank
at pp = 2) and the medians' sum beside the median step; writes ``bench/results/<out>`` with the
machine's load average before and after (``ndtrain.tools.bench_utils.write_result``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DIM, LAYERS, HEADS, VOCAB, T, B, FFN = 256, 8, 8, 8192, 256, 8, 768


def reference_cfg(world: int, pp: int = 1, schedule: str = "1f1b", m: int = 0):
    """The reference model in ndtrain's config; ``pp`` stages of ``schedule`` with ``m`` microbatches."""
    from ndtrain.config import load_config

    over = {"model.dim": DIM, "model.n_layers": LAYERS, "model.n_heads": HEADS, "model.vocab_size": VOCAB,
            "model.ffn_hidden": FFN, "model.n_kv_heads": 0, "model.tie_embeddings": False,
            "model.rope_theta": 500000.0, "model.max_seq_len": T, "training.activation_checkpoint": "none",
            "data.seq_len": T, "training.global_batch_size": B * max(1, world // pp),
            "training.micro_batch_size": 0, "training.dtype": "bfloat16", "training.device": "cpu",
            "training.grad_clip": 1.0, "parallel.pp": pp, "parallel.pp_schedule": schedule,
            "parallel.pp_microbatches": m}
    return load_config("default", over, world_size=world)


def _measure(rank: int, world: int, pp: int, steps: int, warmup: int) -> dict:
    import torch

    from ndtrain.mesh import ParallelDims
    from ndtrain.train.profiling import PHASES, StepBreakdown
    from ndtrain.train.trainer import Trainer

    cfg = reference_cfg(world, pp, m=2 if pp > 1 else 0)
    tr = Trainer(cfg, ParallelDims.from_config(cfg.parallel, world).build_mesh(), torch.device("cpu"))
    for s in range(warmup):
        tr.step(*_batch(s, cfg.training.global_batch_size // tr.mesh.dims.dp))
    bd = StepBreakdown(tr)
    bd.attach()
    for s in range(steps):
        tr.step(*_batch(warmup + s, cfg.training.global_batch_size // tr.mesh.dims.dp))
    bd.detach()
    keys = ("step_s", *PHASES, "overlapped_s")
    med = {k: statistics.median(row[k] for row in bd.steps) for k in keys}
    med["sum_of_phase_medians_s"] = sum(med[k] for k in PHASES)
    return {"rank": rank, "median_s": med, "steps": bd.steps, "threads": torch.get_num_threads()}


def _batch(step: int, rows: int):
    import torch

    g = torch.Generator().manual_seed(step)
    seq = torch.randint(0, VOCAB, (rows, T + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


def _rank(rank: int, world: int, pp: int, steps: int, warmup: int) -> dict:
    return _measure(rank, world, pp, steps, warmup)


def run_layout(name: str, steps: int, warmup: int) -> list[dict]:
    from ndtrain.spawn import policy_env, running_under, spawn, thread_policy

    if name == "single":
        with running_under(thread_policy(1)):
            return [_measure(0, 1, 1, steps, warmup)]
    p = thread_policy(2)
    return spawn(_rank, 2, (2, steps, warmup), backend="gloo", threads=p.threads, env=policy_env(p),
                 timeout_s=3600.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--layouts", default="single,pp2", help="comma list of single, pp2")
    ap.add_argument("--out", default="step_breakdown.json", help="file name under bench/results/")
    args = ap.parse_args()
    from ndtrain.tools.bench_utils import write_result

    res = {"model": f"dim {DIM}, {LAYERS} layers, {HEADS} heads, vocab {VOCAB}, ffn {FFN}",
           "batch": f"{B} x {T} tokens per dp rank, bf16 autocast, AdamW", "steps": args.steps,
           "warmup": args.warmup, "load_before": os.getloadavg(), "layouts": {}}
    for name in args.layouts.split(","):
        res["layouts"][name] = run_layout(name, args.steps, args.warmup)
        for r in res["layouts"][name]:
            print(name, f"rank {r['rank']}", json.dumps({k: round(v * 1e3, 1) for k, v in r["median_s"].items()}),
                  "(ms)", flush=True)
    res["load_after"] = os.getloadavg()
    print(write_result(ROOT / "bench" / "results" / args.out, res, "cpu"))


if __name__ == "__main__":
    main()
