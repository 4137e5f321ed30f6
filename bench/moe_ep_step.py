"""MoE training step with expert parallel (ep = 2) against replicated experts (dp = 2), equal work.

    python bench/moe_ep_step.py              # E = 8 and 32 experts, 12 timed steps each
    python bench/moe_ep_step.py --steps 4    # quicker

Two gloo ranks train the same MoE model (2 layers, C = 256, E experts of hidden 256, top-2, float32)
on the same global batch (2 x 8 sequences of 128 tokens, each rank its half) with the ndtrain
``Trainer``:

* ``dp2``: ``dp_shard = 2, ep = 1`` -- every rank holds all E experts and runs them on its own tokens;
  the expert gradients join the data-parallel all-reduce (axis ``dp``);
* ``ep2``: ``dp_shard = 2, ep = 2`` -- each rank holds E / 2 experts; tokens travel to their
  experts and back by all-to-all (dispatch + combine forward, their inverses backward); the
  expert gradients need no reduction (``edp`` has size 1).

Steps alternate between the two layouts so machine noise hits both alike. Per step: wall time
(median over steps, the slower rank), the seconds spent inside collectives by mesh axis (from the
flight recorder's entries: issue to completion of each recorded collective on this rank, so a
wait for a slower peer counts as communication), the bytes per axis (``ndtrain.parallel.comm``
counters; ``moe_a2a_bytes``, the step metric, is the ep bytes summed over ranks) and, for ep2, the all-to-all bytes against the uniform-routing formula
``4 L N k C b (ep-1)/ep`` (L MoE layers, N tokens per rank; ``bench/moe_all_to_all.py`` breaks the
same down per direction and checks the exact count). Every collective here is blocking (no overlap
of the all-to-all with compute), so the share is the exposed communication.

Writes ``bench/results/moe_ep_step.json``. Each rank runs one thread; the machine's load is recorded.
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

C, L, FE, K, B, T, VOCAB = 256, 2, 256, 2, 8, 128, 2048


def make(world: int, experts: int, ep: int) -> Trainer:
    m = ModelConfig(vocab_size=VOCAB, dim=C, n_layers=L, n_heads=8, ffn_hidden=K * FE, max_seq_len=T,
                    moe_experts=experts, moe_top_k=K, moe_ffn_hidden=FE)
    cfg = Config(model=m, data=DataConfig(seq_len=T),
                 training=TrainingConfig(dtype="float32", global_batch_size=B * world, micro_batch_size=0,
                                         lr=1e-3, warmup_steps=0),
                 parallel=ParallelConfig(dp_shard=world, ep=ep))
    return Trainer(cfg, ParallelDims.from_config(cfg.parallel, world).build_mesh(), torch.device("cpu"))


def comm_seconds(entries: list[dict]) -> dict[str, float]:
    """Seconds from issue to completion of the recorded collectives, summed by mesh axis."""
    out: dict[str, float] = {}
    for e in entries:
        if e["t_end"] is not None:
            out[e["axis"]] = out.get(e["axis"], 0.0) + e["t_end"] - e["t_start"]
    return out


def _rank(rank: int, world: int, experts: int, steps: int) -> dict:
    rec = flight_recorder.configure(600.0, 100_000, None)
    runs = {"dp2": make(world, experts, 1), "ep2": make(world, experts, world)}
    samples: dict[str, list[dict]] = {k: [] for k in runs}
    for step in range(steps + 2):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, VOCAB, (B * world, T), generator=g)[rank * B:(rank + 1) * B]
        for name, tr in runs.items():
            dist.barrier()
            tr.mesh.reset_stats()
            rec.entries.clear()
            t0 = time.perf_counter()
            out = tr.step(x, torch.roll(x, -1, 1))
            wall = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)  # the slower rank sets the step time
            if step >= 2:  # warm-up
                samples[name].append({"wall_s": wall.item(), "comm_s": comm_seconds(list(rec.entries)),
                                      "bytes": tr.mesh.reset_stats(), "loss": out["loss"],
                                      "moe_a2a_bytes": out.get("moe_a2a_bytes")})
    res = {"rank": rank, "experts": experts}
    for name, rows in samples.items():
        axes = sorted({a for r in rows for a in r["comm_s"]})
        med = statistics.median(r["wall_s"] for r in rows)
        comm = {a: statistics.median(r["comm_s"].get(a, 0.0) for r in rows) for a in axes}
        res[name] = {"step_median_s": med, "comm_median_s": comm,
                     "share": {a: s / med for a, s in comm.items()},
                     "bytes_per_step": rows[-1]["bytes"], "moe_a2a_bytes": rows[-1]["moe_a2a_bytes"],
                     "n_params_local": sum(p.numel() for p in runs[name].model.parameters()),
                     "losses": [r["loss"] for r in rows]}
    n = B * T
    res["a2a_theory_bytes"] = 4 * L * n * K * C * 4 * (world - 1) / world
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    rows = []
    for experts in (8, 32):
        rows += spawn(_rank, 2, (experts, args.steps), backend="gloo", threads=1, timeout_s=1800)
    for r in rows:
        dp, ep = r["dp2"], r["ep2"]
        a2a = ep["bytes_per_step"].get("ep", 0.0)
        print(f"E={r['experts']:>2} rank {r['rank']}: step dp2 {dp['step_median_s'] * 1e3:7.1f} ms "
              f"(dp comm {dp['share'].get('dp', 0.0):.0%}), ep2 {ep['step_median_s'] * 1e3:7.1f} ms "
              f"(ep a2a {ep['share'].get('ep', 0.0):.0%}, dp {ep['share'].get('dp', 0.0):.0%}) | "
              f"ep bytes {a2a / 1e6:.2f} MB vs formula {r['a2a_theory_bytes'] / 1e6:.2f} MB "
              f"({a2a / r['a2a_theory_bytes']:.3f}) | dp bytes dp2 {dp['bytes_per_step'].get('dp', 0) / 1e6:.1f} MB, "
              f"ep2 {ep['bytes_per_step'].get('dp', 0) / 1e6:.1f} MB")
    out = write_result(ROOT / "bench" / "results" / "moe_ep_step.json",
                       {"C": C, "layers": L, "expert_hidden": FE, "top_k": K, "tokens_per_rank": B * T,
                        "dtype": "float32", "steps": args.steps, "rows": rows}, "cpu")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
