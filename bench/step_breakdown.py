"""Where a training step's time goes: forward, backward, optimizer, communication waits, bookkeeping.

    python bench/step_breakdown.py [--steps 8] [--warmup 3] [--layouts single,pp2] [--pp-schedule 1f1b]
        [--pp-microbatches 4] [--switch-interval S] [--out step_breakdown.json]

``Trainer.step`` of the reference model (dim 256, 8 layers, 8 heads, vocab 8192, 8 sequences x 256
tokens per data-parallel rank, bf16 autocast, AdamW) split into phases by
``ndtrain.train.profiling.StepBreakdown`` (wall-clock spans; the waits of the counted primitives),
for one process and for pp = 2 (``--pp-schedule``, default 1F1B, ``--pp-microbatches``, default 4 as in
``bench/peers.py``; two gloo processes). Threads follow
``ndtrain.spawn.thread_policy``. Reports the median of each phase over the timed steps (per rank
at pp = 2) and the medians' sum beside the median step; for one process also the phases of
``bench/peers_plain.py``'s plain loop (forward, backward, clip + AdamW), its steps alternating with
ndtrain's in the same process so load hits both alike; writes ``bench/results/<out>`` with the
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


def _measure(rank: int, world: int, pp: int, steps: int, warmup: int, schedule: str = "1f1b", m: int = 4,
             switch_s: float = 0.0) -> dict:
    import torch

    from ndtrain.parallel.pp import runtime

    if switch_s > 0:  # the GIL switch interval the pipeline step runs under (before / after comparisons)
        runtime.SWITCH_INTERVAL_S = switch_s

    from ndtrain.mesh import ParallelDims
    from ndtrain.train.profiling import PHASES, StepBreakdown
    from ndtrain.train.trainer import Trainer

    cfg = reference_cfg(world, pp, schedule, m=m if pp > 1 else 0)
    tr = Trainer(cfg, ParallelDims.from_config(cfg.parallel, world).build_mesh(), torch.device("cpu"))
    rows = cfg.training.global_batch_size // tr.mesh.dims.dp
    plain = _PlainPhases() if world == 1 else None  # the plain loop's phases, steps alternating
    bd = StepBreakdown(tr)
    for s in range(warmup + steps):
        if s == warmup:
            bd.attach()
        for side in ("ndtrain", "plain") if s % 2 == 0 else ("plain", "ndtrain"):
            if side == "ndtrain":
                tr.step(*_batch(s, rows))
            elif plain is not None:
                plain.step(*_batch(s, rows), timed=s >= warmup)
    bd.detach()
    keys = ("step_s", *PHASES, "overlapped_s")
    med = {k: statistics.median(row[k] for row in bd.steps) for k in keys}
    med["sum_of_phase_medians_s"] = sum(med[k] for k in PHASES)
    out = {"rank": rank, "median_s": med, "steps": bd.steps, "threads": torch.get_num_threads()}
    if plain is not None:
        out["plain_median_s"] = {k: statistics.median(v) for k, v in plain.times.items()}
    return out


class _PlainPhases:
    """``bench/peers_plain.py``'s Llama under a plain loop, its phases timed the same way (spans)."""

    def __init__(self):
        from bench.peers_plain import adamw, build

        self.model = build()
        self.params = list(self.model.parameters())
        self.opt = adamw(self.params)
        self.times: dict[str, list[float]] = {k: [] for k in ("step_s", "forward", "backward", "optimizer")}

    def step(self, x, y, timed: bool) -> None:
        import time

        import torch

        from bench.peers_plain import loss_fn

        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(self.model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt()
        t3 = time.perf_counter()
        if timed:
            for k, v in (("step_s", t3 - t0), ("forward", t1 - t0), ("backward", t2 - t1), ("optimizer", t3 - t2)):
                self.times[k].append(v)


def _batch(step: int, rows: int):
    import torch

    g = torch.Generator().manual_seed(step)
    seq = torch.randint(0, VOCAB, (rows, T + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


def _rank(rank: int, world: int, pp: int, steps: int, warmup: int, schedule: str, m: int, switch_s: float) -> dict:
    return _measure(rank, world, pp, steps, warmup, schedule, m, switch_s)


def run_layout(name: str, steps: int, warmup: int, schedule: str = "1f1b", m: int = 4,
               switch_s: float = 0.0) -> list[dict]:
    from ndtrain.spawn import policy_env, running_under, spawn, thread_policy

    if name == "single":
        with running_under(thread_policy(1)):
            return [_measure(0, 1, 1, steps, warmup, switch_s=switch_s)]
    p = thread_policy(2)
    return spawn(_rank, 2, (2, steps, warmup, schedule, m, switch_s), backend="gloo", threads=p.threads, env=policy_env(p),
                 timeout_s=3600.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--layouts", default="single,pp2", help="comma list of single, pp2")
    ap.add_argument("--pp-schedule", default="1f1b", help="pp2's schedule (gpipe, 1f1b, interleaved, zero_bubble, dualpipev)")
    ap.add_argument("--pp-microbatches", type=int, default=4, help="pp2's microbatches (bench/peers.py's pp rows: 4)")
    ap.add_argument("--switch-interval", type=float, default=0.0,
                    help="GIL switch interval (s) of the pipeline step; 0: the runtime's (0.0002); 0.005: Python's default")
    ap.add_argument("--out", default="step_breakdown.json", help="file name under bench/results/")
    args = ap.parse_args()
    from ndtrain.tools.bench_utils import write_result

    res = {"model": f"dim {DIM}, {LAYERS} layers, {HEADS} heads, vocab {VOCAB}, ffn {FFN}",
           "batch": f"{B} x {T} tokens per dp rank, bf16 autocast, AdamW", "steps": args.steps,
           "warmup": args.warmup, "pp": f"{args.pp_schedule}, m {args.pp_microbatches}", "switch_interval_s": args.switch_interval or None, "load_before": os.getloadavg(), "layouts": {}}
    for name in args.layouts.split(","):
        res["layouts"][name] = run_layout(name, args.steps, args.warmup, args.pp_schedule, args.pp_microbatches,
                                          args.switch_interval)
        for r in res["layouts"][name]:
            print(name, f"rank {r['rank']}", json.dumps({k: round(v * 1e3, 1) for k, v in r["median_s"].items()}),
                  "(ms)", flush=True)
            if "plain_median_s" in r:
                print(name, "plain loop", json.dumps({k: round(v * 1e3, 1) for k, v in r["plain_median_s"].items()}),
                      "(ms)", flush=True)
    res["load_after"] = os.getloadavg()
    print(write_result(ROOT / "bench" / "results" / args.out, res, "cpu"))


if __name__ == "__main__":
    main()
