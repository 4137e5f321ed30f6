"""Step time of tensor parallel (TP = 2, with and without sequence parallel) against TP = 1 on
the same 2 processes (i.e. plain data parallel, DP = 2).

    python bench/tp_step_time.py [--steps 8] [--dim 256] [--seq 256]

One command spawns 2 gloo processes (one CPU thread each) and builds, on the same model
(Llama-style, float32, vocab 4096, 4 layers, 8 heads, 4 kv heads) and the same global batch
(8 x seq tokens), the trainers

* ``tp1_dp2``: TP = 1 on 2 processes (data parallel), the baseline;
* ``tp2``, ``tp2_sp``: one tensor-parallel group of 2, without / with sequence parallel;
* ``tp1_one_process``: for context, a single-process trainer on rank 0 (rank 1 idles).

Steps alternate between the trainers (A, B, C, D, A, B, ...) so machine noise hits all alike.
Reported: median step time over ``--steps`` steps after 2 warm-up steps, the ratio to
``tp1_dp2``, bytes sent per rank per step on each mesh axis and parameters per rank. Writes
``bench/results/tp_step_time.json``. On a CPU host the collectives run over loopback TCP (gloo), so
the ratio shows the cost of TP's per-layer collectives, not what NVLink would give.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ndtrain.config import Config, ModelConfig, ParallelConfig, TrainingConfig, validate
from ndtrain.mesh import ParallelDims
from ndtrain.spawn import spawn
from ndtrain.train.loop import Trainer


def make_cfg(args, world: int, **par) -> Config:
    cfg = Config(model=ModelConfig(vocab_size=4096, dim=args.dim, n_layers=4, n_heads=8, n_kv_heads=4,
                                   ffn_hidden=3 * args.dim, max_seq_len=args.seq, rope_theta=10000.0),
                 training=TrainingConfig(steps=args.steps + 2, dtype="float32", global_batch_size=8,
                                         lr=1e-3, warmup_steps=1),
                 parallel=ParallelConfig(**{"dp_shard": -1, **par}))
    cfg.data.seq_len = args.seq
    validate(cfg, world)
    return cfg


class Run:
    """One trainer of the comparison and its timings."""

    def __init__(self, args, world: int, **par):
        cfg = make_cfg(args, world, **par)
        self.mesh = ParallelDims.from_config(cfg.parallel, world).build_mesh()
        self.tr = Trainer(cfg, self.mesh, torch.device("cpu"))
        self.times: list[float] = []
        self.comm: dict = {}

    def step(self, step: int, seq: int) -> None:
        dp = self.mesh.group("dp")
        local = 8 // dp.size
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, 4096, (8, seq + 1), generator=g)
        inputs, labels = x[:, :-1], x[:, 1:]
        sl = slice(dp.rank * local, (dp.rank + 1) * local)
        self.mesh.reset_stats()
        t0 = time.perf_counter()
        self.tr.step(inputs[sl], labels[sl])
        dt = time.perf_counter() - t0
        self.comm = self.mesh.reset_stats()
        if step >= 2:
            self.times.append(dt)

    def result(self) -> dict:
        return {"median_step_s": statistics.median(self.times), "steps_s": self.times,
                "comm_bytes_per_step": self.comm,
                "params_per_rank": sum(p.numel() for p in self.tr.model.parameters())}


def _worker(rank: int, world: int, args) -> dict:
    runs = {"tp1_dp2": Run(args, world), "tp2": Run(args, world, tp=2),
            "tp2_sp": Run(args, world, tp=2, sequence_parallel=True)}
    single = Run(args, 1) if rank == 0 else None
    for step in range(args.steps + 2):
        for run in runs.values():
            dist.barrier()
            run.step(step, args.seq)
        dist.barrier()
        if single is not None:
            single.step(step, args.seq)
    res = {k: r.result() for k, r in runs.items()}
    if rank == 0:
        res["tp1_one_process"] = single.result()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--seq", type=int, default=256)
    args = ap.parse_args()
    res = {"config": vars(args) | {"cpus": os.cpu_count(), "threads_per_process": 1}}
    res.update(spawn(_worker, 2, (args,), backend="gloo", threads=1)[0])
    base = res["tp1_dp2"]["median_step_s"]
    for name in ("tp1_dp2", "tp2", "tp2_sp", "tp1_one_process"):
        r = res[name]
        r["ratio_vs_tp1_dp2"] = r["median_step_s"] / base
        mib = {k: round(v / 2**20, 2) for k, v in r["comm_bytes_per_step"].items() if v}
        print(f"{name:>16}: {r['median_step_s'] * 1e3:8.1f} ms/step  x{r['ratio_vs_tp1_dp2']:.2f} vs tp1_dp2  "
              f"params/rank {r['params_per_rank'] / 1e6:.2f}M  comm MiB/step {mib}")
    dest = ROOT / "bench" / "results" / "tp_step_time.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(res, indent=1))
    print(f"wrote {dest}")


if __name__ == "__main__":
    main()
