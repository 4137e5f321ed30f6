"""DualPipeV step time with its F&B pairs overlapped in two threads vs run one after the other.

    python bench/dualpipev_overlap.py                     # 8 timed steps per mode, link delay 0 and 20 ms
    python bench/dualpipev_overlap.py --steps 4 --delays-ms 0   # quicker

Four gloo ranks, ``pp2 x ep2`` (ep borrows dp_shard's 2 ranks, so dp = 2 too), train one MoE model
(4 layers, C = 256, 8 experts of hidden 512, top-2, float32, T = 128, 8 microbatches of 1 sequence
per rank and step) under DualPipeV with the ndtrain ``Trainer``, twice: ``parallel.pp_overlap=false``
(each pair's forward, then its backward) and ``true`` (the pair's backward in a worker thread,
``ndtrain.parallel.pp.pairs``). Steps alternate between the two so machine noise hits both alike.

Per step: wall time (the slower rank), and the seconds each thread spent blocked inside expert
all-to-alls (``ep.collectives.run_collective`` timed from issue to return, per thread: the main
thread's share is the exposed all-to-all time). Medians over steps; the losses of both modes are
printed (they are bitwise equal, ``tests/parallel/test_pp_overlap.py``).

``--delays-ms``: each expert all-to-all also sleeps this long in the thread that issued it after it
completes -- an emulated slow link (latency that costs no CPU, as an inter-node hop would). On a
machine whose cores the ranks already saturate, the overlap has no idle core to fill and can only
hide such waits; with delay 0 it measures the real gloo all-to-all on this machine.

Writes ``bench/results/dualpipev_overlap.json``. Each rank runs one intra-op thread; the machine's
load is recorded with the result.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ndtrain.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainingConfig
from ndtrain.mesh import ParallelDims
from ndtrain.parallel.ep import collectives
from ndtrain.spawn import spawn
from ndtrain.tools.bench_utils import write_result
from ndtrain.train.loop import Trainer

C, L, FE, E, K, T, VOCAB, M = 256, 4, 512, 8, 2, 128, 2048, 8
WORLD, DP = 4, 2


class A2ATimer:
    """Wraps ``collectives.run_collective``: seconds blocked in it, per thread (main / worker)."""

    def __init__(self, delay_s: float = 0.0):
        self.inner, self.delay_s = collectives.run_collective, delay_s
        self.seconds = {"main": 0.0, "worker": 0.0}
        self.lock = threading.Lock()
        collectives.run_collective = self

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            out = self.inner(*args, **kwargs)
            if self.delay_s:
                time.sleep(self.delay_s)
            return out
        finally:
            who = "main" if threading.current_thread() is threading.main_thread() else "worker"
            with self.lock:
                self.seconds[who] += time.perf_counter() - t0

    def take(self) -> dict[str, float]:
        with self.lock:
            out, self.seconds = self.seconds, {"main": 0.0, "worker": 0.0}
        return out


def make(overlap: str) -> Trainer:
    m = ModelConfig(vocab_size=VOCAB, dim=C, n_layers=L, n_heads=8, ffn_hidden=K * FE, max_seq_len=T,
                    moe_experts=E, moe_top_k=K, moe_ffn_hidden=FE)
    cfg = Config(model=m, data=DataConfig(seq_len=T),
                 training=TrainingConfig(dtype="float32", global_batch_size=M * DP, micro_batch_size=1,
                                         lr=1e-3, warmup_steps=0),
                 parallel=ParallelConfig(pp=2, ep=2, pp_schedule="dualpipev", pp_overlap=overlap))
    return Trainer(cfg, ParallelDims.from_config(cfg.parallel, WORLD).build_mesh(), torch.device("cpu"))


def _rank(rank: int, world: int, steps: int, delay_ms: float) -> dict:
    timer = A2ATimer(delay_ms / 1e3)
    runs = {"sequential": make("false"), "overlapped": make("true")}
    assert runs["overlapped"].pipeline.runtime.overlap and not runs["sequential"].pipeline.runtime.overlap
    dp = runs["sequential"].mesh.group("dp")
    samples: dict[str, list[dict]] = {k: [] for k in runs}
    for step in range(steps + 2):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, VOCAB, (M * DP, T), generator=g)[dp.rank * M:(dp.rank + 1) * M]
        for name, tr in runs.items():
            dist.barrier()
            timer.take()
            t0 = time.perf_counter()
            out = tr.step(x, torch.roll(x, -1, 1))
            wall = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)  # the slower rank sets the step time
            a2a = timer.take()
            if step >= 2:  # warm-up
                samples[name].append({"wall_s": wall.item(), "a2a_main_s": a2a["main"],
                                      "a2a_worker_s": a2a["worker"], "loss": out["loss"]})
    res = {"rank": rank, "delay_ms": delay_ms}
    for name, rows in samples.items():
        med = statistics.median(r["wall_s"] for r in rows)
        main = statistics.median(r["a2a_main_s"] for r in rows)
        res[name] = {"step_median_s": med, "step_s": [r["wall_s"] for r in rows],
                     "a2a_main_median_s": main, "a2a_worker_median_s": statistics.median(r["a2a_worker_s"] for r in rows),
                     "a2a_main_share": main / med, "losses": [r["loss"] for r in rows]}
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--delays-ms", default="0,20", help="emulated link delay per all-to-all, comma-separated")
    args = ap.parse_args()
    delays = [float(d) for d in args.delays_ms.split(",")]
    rows = []
    for delay in delays:
        rows += spawn(_rank, WORLD, (args.steps, delay), backend="gloo", threads=1, timeout_s=1800)
    for r in rows:
        s, o = r["sequential"], r["overlapped"]
        print(f"delay {r['delay_ms']:g} ms, rank {r['rank']}: step sequential {s['step_median_s'] * 1e3:7.1f} ms (a2a on main "
              f"{s['a2a_main_share']:.0%}), overlapped {o['step_median_s'] * 1e3:7.1f} ms (a2a on main "
              f"{o['a2a_main_share']:.0%}, in the B thread {o['a2a_worker_median_s'] * 1e3:.1f} ms) | "
              f"speed-up {s['step_median_s'] / o['step_median_s']:.3f}x | losses equal: {s['losses'] == o['losses']}")
    out = write_result(ROOT / "bench" / "results" / "dualpipev_overlap.json",
                       {"layout": "pp2 x ep2 (dp 2), DualPipeV, 4 gloo ranks", "C": C, "layers": L,
                        "experts": E, "expert_hidden": FE, "top_k": K, "seq_len": T, "microbatches": M,
                        "micro_batch_size": 1, "dtype": "float32", "steps": args.steps, "delays_ms": delays,
                        "rows": rows}, "cpu")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
