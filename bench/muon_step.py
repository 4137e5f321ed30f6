"""Training step with Muon against AdamW, one process and sharded (ZeRO-1 / ZeRO-3 on 2 ranks).

    python bench/muon_step.py              # 8 timed steps per run
    python bench/muon_step.py --steps 4    # quicker

A Llama-style model (C = 256, 4 layers, FFN 688, vocabulary 2048, float32) trains on 8 sequences
of 128 tokens per rank with the ndtrain ``Trainer`` under ``training.optimizer`` adamw and muon;
steps alternate between the two so machine noise hits both alike. Per run: median step wall time
(the slower rank), median ``optimizer.step`` time (for Muon: momentum, owner routing,
Newton-Schulz, update), the Newton-Schulz FLOPs per step on this rank (``ns_flops`` of the matrices
it orthogonalises, each counted once in the shard group: it is what HFU would add; MFU excludes it)
against the model's 6 N D training FLOPs per rank, and the bytes the orthogonalisation moved per
axis (``ndtrain.parallel.comm`` counters) against ``route_bytes``.

Writes ``bench/results/muon_step.json``. Each rank runs one thread; the machine's load is recorded.
"""
from __future__ import annotations

import argparse
import functools
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
from ndtrain.parallel.muon.sharded import route_bytes
from ndtrain.spawn import spawn
from ndtrain.tools.bench_utils import write_result
from ndtrain.train.loop import Trainer

C, L, F, VOCAB, B, T = 256, 4, 688, 2048, 8, 128


def make(world: int, optimizer: str, zero: int) -> Trainer:
    m = ModelConfig(vocab_size=VOCAB, dim=C, n_layers=L, n_heads=8, n_kv_heads=4, ffn_hidden=F, max_seq_len=T)
    cfg = Config(model=m, data=DataConfig(seq_len=T),
                 training=TrainingConfig(dtype="float32", global_batch_size=B * world, lr=1e-3, warmup_steps=0,
                                         optimizer=optimizer),
                 parallel=ParallelConfig(dp_shard=world, zero_stage=zero))
    return Trainer(cfg, ParallelDims.from_config(cfg.parallel, world).build_mesh(), torch.device("cpu"))


def _timed_opt(tr: Trainer, sink: list) -> None:
    step = tr.optimizer.step

    @functools.wraps(step)  # keeps the LR scheduler's marker attribute
    def wrapped(*a, **k):
        t0 = time.perf_counter()
        out = step(*a, **k)
        sink.append(time.perf_counter() - t0)
        return out

    tr.optimizer.step = wrapped


def _count_orth_bytes(tr: Trainer, sink: list) -> None:
    """Bytes per axis moved inside each orthogonalisation (the Muon-only traffic)."""
    f, stats = tr.optimizer.orthogonalize, tr.mesh.stats

    def wrapped(params, updates, steps):
        before = dict(stats)
        out = f(params, updates, steps)
        sink.append({a: v - before.get(a, 0.0) for a, v in stats.items() if v != before.get(a, 0.0)})
        return out

    tr.optimizer.orthogonalize = wrapped


def _ns_plan(orth, steps: int) -> tuple[int, dict]:
    """NS FLOPs this rank runs per step (routed matrices only on their owner) and the owner plan's
    ``route_bytes`` per shard axis (float32 masters)."""
    by_name = {m.name: m for m in orth.matrices.values()}
    flops = sum(m.flops(steps) for m in by_name.values() if not m.routed)
    predicted = {}
    for axis, (names, owner, sizes) in orth.owners.items():
        group = by_name[names[0]].route[2]
        flops += sum(by_name[n].flops(steps) for n, o in zip(names, owner) if o == group.rank)
        predicted[axis] = route_bytes(sizes, owner, group.rank, group.size, 4)
    return flops, predicted


def _rank(rank: int, world: int, zero: int, steps: int) -> dict:
    runs = {o: make(world, o, zero) for o in ("adamw", "muon")}
    orth = runs["muon"].optimizer.orthogonalize
    opt_t: dict[str, list] = {o: [] for o in runs}
    for o, tr in runs.items():
        _timed_opt(tr, opt_t[o])
    muon_bytes: list = []
    _count_orth_bytes(runs["muon"], muon_bytes)
    walls: dict[str, list] = {o: [] for o in runs}
    for step in range(steps + 2):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, VOCAB, (B * world, T), generator=g)[rank * B:(rank + 1) * B]
        for o, tr in runs.items():
            if world > 1:
                dist.barrier()
            t0 = time.perf_counter()
            tr.step(x, torch.roll(x, -1, 1))
            wall = torch.tensor([time.perf_counter() - t0])
            if world > 1:
                dist.all_reduce(wall, op=dist.ReduceOp.MAX)
            if step >= 2:
                walls[o].append(wall.item())
    n_params = sum(p.numel() for p in runs["adamw"].model.parameters())
    model_flops = 6 * n_params * B * T
    ns, predicted = _ns_plan(orth, runs["muon"].cfg.training.muon_ns_steps)
    res = {"rank": rank, "world": world, "zero_stage": zero, "ns_flops_per_step": ns,
           "model_flops_per_step_6ND": model_flops, "ns_over_model": ns / model_flops,
           "muon_route_bytes_predicted": predicted}
    for o in runs:
        res[o] = {"step_median_s": statistics.median(walls[o]),
                  "optimizer_step_median_s": statistics.median(opt_t[o][2:])}
    res["muon_over_adamw_step"] = res["muon"]["step_median_s"] / res["adamw"]["step_median_s"]
    res["muon_route_bytes_measured"] = muon_bytes[-1]
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = [_rank(0, 1, 0, args.steps)]
    for zero in (1, 3):
        rows += spawn(_rank, 2, (zero, args.steps), backend="gloo", threads=1, timeout_s=1800)
    for r in rows:
        print(f"world {r['world']} zero {r['zero_stage']} rank {r['rank']}: step adamw "
              f"{r['adamw']['step_median_s'] * 1e3:7.1f} ms, muon {r['muon']['step_median_s'] * 1e3:7.1f} ms "
              f"(x{r['muon_over_adamw_step']:.2f}); optimizer.step adamw "
              f"{r['adamw']['optimizer_step_median_s'] * 1e3:6.1f} ms, muon "
              f"{r['muon']['optimizer_step_median_s'] * 1e3:6.1f} ms; NS {r['ns_flops_per_step'] / 1e9:.3f} GFLOP "
              f"= {r['ns_over_model']:.2%} of 6ND; route bytes {r['muon_route_bytes_measured']} "
              f"(predicted {r['muon_route_bytes_predicted']})")
    out = write_result(ROOT / "bench" / "results" / "muon_step.json",
                       {"C": C, "layers": L, "ffn": F, "vocab": VOCAB, "tokens_per_rank": B * T,
                        "dtype": "float32", "steps": args.steps, "rows": rows}, "cpu")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
