"""MoE step under expert parallel with learned vs forced-balanced routing (``training.moe_routing``).

    python bench/moe_routing.py              # 8 timed steps per routing
    python bench/moe_routing.py --steps 4    # quicker

Two gloo ranks (dp_shard 2, ep 2, E 8 experts of hidden 256, top-2, C 256, 2 layers, float32, each
rank 8 x 128 tokens) train the same model twice, once per routing, steps alternating so machine
noise hits both alike. Per routing: the step wall time (median, the slower rank), the seconds inside
the ep all-to-alls (flight recorder: issue to completion, so waiting for the busier peer counts),
the step's MoE figures -- tokens per expert and per ep rank (max / mean, global) and the busiest
rank's peak memory (CPU max RSS: the process's, not only the model's).

Writes ``bench/results/moe_routing.json``. Each rank runs one thread; the machine's load is recorded.
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
FIGURES = ("moe_tokens_per_expert_max", "moe_tokens_per_expert_mean", "moe_tokens_per_ep_rank_max",
           "moe_tokens_per_ep_rank_mean", "moe_load_max_mean", "moe_peak_mem_bytes_max", "moe_routing", "loss")


def make(world: int, routing: str) -> Trainer:
    m = ModelConfig(vocab_size=VOCAB, dim=C, n_layers=L, n_heads=8, ffn_hidden=K * FE, max_seq_len=T,
                    moe_experts=E, moe_top_k=K, moe_ffn_hidden=FE)
    cfg = Config(model=m, data=DataConfig(seq_len=T),
                 training=TrainingConfig(dtype="float32", global_batch_size=B * world, micro_batch_size=0,
                                         lr=1e-3, warmup_steps=0, moe_routing=routing),
                 parallel=ParallelConfig(dp_shard=world, ep=world))
    torch.manual_seed(0)
    return Trainer(cfg, ParallelDims.from_config(cfg.parallel, world).build_mesh(), torch.device("cpu"))


def _rank(rank: int, world: int, steps: int) -> dict:
    rec = flight_recorder.configure(600.0, 100_000, None)
    runs = {"learned": make(world, "learned"), "balanced": make(world, "balanced")}
    samples: dict[str, list[dict]] = {k: [] for k in runs}
    for step in range(steps + 2):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, VOCAB, (B * world, T), generator=g)[rank * B:(rank + 1) * B]
        for name, tr in runs.items():
            dist.barrier()
            rec.entries.clear()
            t0 = time.perf_counter()
            out = tr.step(x, torch.roll(x, -1, 1))
            wall = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)  # the slower rank sets the step time
            ep_s = sum(e["t_end"] - e["t_start"] for e in rec.entries if e["axis"] == "ep" and e["t_end"])
            if step >= 2:  # warm-up
                samples[name].append({"wall_s": wall.item(), "ep_s": ep_s, **{k: out[k] for k in FIGURES}})
    res = {"rank": rank}
    for name, rows in samples.items():
        med = statistics.median(r["wall_s"] for r in rows)
        ep_med = statistics.median(r["ep_s"] for r in rows)
        res[name] = {"step_median_s": med, "ep_a2a_median_s": ep_med, "ep_a2a_share": ep_med / med,
                     "last_step": {k: rows[-1][k] for k in FIGURES}}
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    rows = spawn(_rank, 2, (args.steps,), backend="gloo", threads=1, timeout_s=1800)
    for r in rows:
        for name in ("learned", "balanced"):
            d, f = r[name], r[name]["last_step"]
            print(f"rank {r['rank']} {name:>8}: step {d['step_median_s'] * 1e3:7.1f} ms, ep a2a "
                  f"{d['ep_a2a_share']:.0%} | tokens/expert {f['moe_tokens_per_expert_max']:.0f}/"
                  f"{f['moe_tokens_per_expert_mean']:.0f}, per ep rank {f['moe_tokens_per_ep_rank_max']:.0f}/"
                  f"{f['moe_tokens_per_ep_rank_mean']:.0f} | busiest-rank peak "
                  f"{f['moe_peak_mem_bytes_max'] / 2**20:.0f} MiB")
    out = write_result(ROOT / "bench" / "results" / "moe_routing.json",
                       {"C": C, "layers": L, "experts": E, "expert_hidden": FE, "top_k": K, "tokens_per_rank": B * T,
                        "dtype": "float32", "steps": args.steps, "layout": "dp_shard2 x ep2", "rows": rows}, "cpu")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
