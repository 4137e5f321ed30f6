"""Shared-expert overlap of the EP dispatch all-to-all (``parallel.moe_shared_overlap``): step time
and the share of the step spent waiting in the all-to-all, overlap off vs on.

    python bench/moe_overlap.py              # 12 timed steps per setting
    python bench/moe_overlap.py --steps 4    # quicker

Two gloo ranks (``dp_shard = 2, ep = 2``) train the same MoE model (2 layers, C = 256, E = 8
experts of hidden 256, top-2, ``--shared`` shared experts of hidden 256 each, float32) on the same
global batch (2 x 8 sequences of 128 tokens), once with ``moe_shared_overlap`` off and once on,
alternating step by step so machine noise hits both alike (medians over steps, the slower rank).

"Waiting" is the time this rank's thread is blocked in ``Work.wait`` of an ``ep``-axis
all-to-all (a bench-only observer around the flight recorder's ``wait``; forward and backward
apart, ``a2a_fwd_*`` holding the forward count exchange, dispatch and combine): for a synchronous
collective that is its whole duration, for the overlapped dispatch only what the shared experts
did not hide. The count exchange (tiny) and the combine and backward all-to-alls stay
synchronous in both settings, so the saving is bounded by the forward dispatch's time. The
losses of the two settings are checked to be equal (same ops, other order).

Writes ``bench/results/moe_overlap.json``. Each rank runs one thread; the machine's load is recorded.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ndtrain.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainingConfig
from ndtrain.mesh import ParallelDims
from ndtrain.parallel import flight_recorder
from ndtrain.spawn import spawn
from ndtrain.tools.bench_utils import write_result
from ndtrain.train.loop import Trainer

C, L, FE, E, K, B, T, VOCAB = 256, 2, 256, 8, 2, 8, 128, 2048


def make(world: int, shared: int, overlap: bool) -> Trainer:
    m = ModelConfig(vocab_size=VOCAB, dim=C, n_layers=L, n_heads=8, ffn_hidden=K * FE, max_seq_len=T,
                    moe_experts=E, moe_top_k=K, moe_ffn_hidden=FE, moe_shared_experts=shared)
    cfg = Config(model=m, data=DataConfig(seq_len=T),
                 training=TrainingConfig(dtype="float32", global_batch_size=B * world, micro_batch_size=0,
                                         lr=1e-3, warmup_steps=0),
                 parallel=ParallelConfig(dp_shard=world, ep=world, moe_shared_overlap=overlap))
    return Trainer(cfg, ParallelDims.from_config(cfg.parallel, world).build_mesh(), torch.device("cpu"))


class WaitTimer:
    """Bench-only: seconds blocked in ``wait`` per (axis, op), around ``rec.wait``."""

    def __init__(self, rec: flight_recorder.FlightRecorder):
        self.blocked: dict[str, float] = {}
        inner = rec.wait

        def timed(work, entry, group):
            t0 = time.perf_counter()
            try:
                return inner(work, entry, group)
            finally:
                phase = "bwd" if torch._C._current_graph_task_id() != -1 else "fwd"
                key = f"{entry['axis']}:{entry['op']}:{phase}"
                self.blocked[key] = self.blocked.get(key, 0.0) + time.perf_counter() - t0

        rec.wait = timed


def _rank(rank: int, world: int, shared: int, steps: int) -> dict:
    rec = flight_recorder.configure(600.0, 0, None)
    timer = WaitTimer(rec)
    runs = {"off": make(world, shared, False), "on": make(world, shared, True)}
    samples: dict[str, list[dict]] = {k: [] for k in runs}
    for step in range(steps + 2):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, VOCAB, (B * world, T), generator=g)[rank * B:(rank + 1) * B]
        for name, tr in runs.items():
            dist.barrier()
            timer.blocked = {}
            t0 = time.perf_counter()
            out = tr.step(x, torch.roll(x, -1, 1))
            wall = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)  # the slower rank sets the step time
            if step >= 2:  # warm-up
                samples[name].append({"wall_s": wall.item(), "blocked": dict(timer.blocked), "loss": out["loss"]})
    res = {"rank": rank}
    for name, rows in samples.items():
        med = statistics.median(r["wall_s"] for r in rows)
        keys = sorted({k for r in rows for k in r["blocked"]})
        blocked = {k: statistics.median(r["blocked"].get(k, 0.0) for r in rows) for k in keys}
        a2a = statistics.median(sum(v for k, v in r["blocked"].items() if k.startswith("ep:all_to_all_v"))
                                for r in rows)
        fwd = statistics.median(r["blocked"].get("ep:all_to_all_v:fwd", 0.0) for r in rows)
        res[name] = {"step_median_s": med, "step_s": [r["wall_s"] for r in rows],
                     "a2a_wait_median_s": a2a, "a2a_wait_share": a2a / med,
                     "a2a_fwd_wait_median_s": fwd, "a2a_fwd_wait_share": fwd / med,
                     "blocked_median_s": blocked, "losses": [r["loss"] for r in rows]}
    res["losses_equal"] = res["off"]["losses"] == res["on"]["losses"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--shared", type=int, default=2, help="shared experts (each of hidden 256)")
    args = ap.parse_args()
    rows = spawn(_rank, 2, (args.shared, args.steps), backend="gloo", threads=1, timeout_s=1800)
    for r in rows:
        off, on = r["off"], r["on"]
        print(f"rank {r['rank']}: " + " | ".join(
            f"{k} step {v['step_median_s'] * 1e3:6.1f} ms, a2a wait {v['a2a_wait_median_s'] * 1e3:5.1f} ms "
            f"({v['a2a_wait_share']:.1%}; fwd {v['a2a_fwd_wait_median_s'] * 1e3:5.1f} ms)" for k, v in (("off", off), ("on", on)))
            + f" | speedup {off['step_median_s'] / on['step_median_s']:.3f}x | losses equal: {r['losses_equal']}")
    out = write_result(ROOT / "bench" / "results" / "moe_overlap.json",
                       {"C": C, "layers": L, "experts": E, "expert_hidden": FE, "top_k": K,
                        "shared_experts": args.shared, "tokens_per_rank": B * T, "dtype": "float32",
                        "steps": args.steps, "rows": rows}, "cpu")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
