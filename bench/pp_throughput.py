"""Pipeline schedules at p = 4: throughput against m, bubble, and activation memory per stage.

Three measurements, 4 gloo processes on this machine:

A. Throughput vs m (GPipe, 1F1B, interleaved v = 2, ZB-H1, DualPipeV for m >= 2p) on a toy pipeline whose stages do
   equal, deterministic work (sleeps: F = t, B = t input grad + t weight grad per rank's share,
   halved per chunk for v = 2), so the numbers show the schedule, not this machine's CPU.
   Reported per (schedule, m): microbatches/s of the fastest of ``--steps`` steps, the mean
   measured idle fraction, the formula's, and the ratio to the bubble-free rate 1 / (3 t) (the
   baseline, i.e. 1 - bubble) and to GPipe at the same m.
B. Peak activation memory per stage, real tiny Transformer (dim 128, 8 layers, T 128, one sequence
   per microbatch, float32, m = 8): ``ndtrain.mem_account.ActivationMeter`` on each rank for every
   schedule, and the ratio to the same stage's peak with m = 1 (one microbatch in flight). GPipe
   holds all m microbatches; 1F1B at most p - r on rank r (Narayanan 2021). DualPipeV needs
   m >= 2p, so its ratio is to 1F1B's m = 1 peak on the same rank (both hold 2 of the 8 layers).
C. Timeline PNGs (``--docs``): planned (simulated) and measured (toy, m = 8) for each schedule in
   ``docs/pp_<planned|measured>_<schedule>.png``.

Usage: ``python bench/pp_throughput.py [--ms 1,2,4,8,16] [--t 0.01] [--steps 3] [--docs]
[--scheds dualpipev,...]``; writes ``bench/results/pp_throughput.json`` (with ``--scheds``, only
those schedules' entries are replaced in the existing file).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ndtrain.parallel.pp.schedules import bubble_formula
from tests.dist_utils import run_ranks
from tests.parallel.test_pp import SleepStage

P = 4
SCHEDS = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1), ("dualpipev", 2))


def _ms(sched: str, ms: list[int]) -> list[int]:
    return [m for m in ms if sched != "dualpipev" or m >= 2 * P]  # DualPipeV: m >= 2p


def _toy(rank: int, world: int, ms: list[int], t: float, steps: int, docs: set, scheds) -> dict:
    from ndtrain.mesh import ParallelDims
    from ndtrain.parallel.pp.observe import ActionTimer
    from ndtrain.parallel.pp.runtime import PipelineRuntime
    from ndtrain.parallel.pp.viz import gather_measured_timeline, render_png, render_text

    mesh = ParallelDims(pp=world, world_size=world).build_mesh()
    out = {}
    for sched, v in scheds:
        chunks = [SleepStage(t / v, first=(rank == 0 and c == 0)) for c in range(v)]
        rt = PipelineRuntime(chunks, mesh.group("pp"), sched, lambda y, _: y.sum())
        timer = ActionTimer()  # timing is an observer: the runtime itself does no timing
        rt.observers.append(timer)
        for m in _ms(sched, ms):
            x = torch.zeros(m, 2, dtype=torch.long)
            best = None
            for _ in range(steps + 1):  # + 1 warm-up step
                rt.run(x, x, m)
                tl = gather_measured_timeline(timer, mesh.group("pp"))
                if best is None or tl.end - tl.start < best.end - best.start:
                    best = tl
            span = best.end - best.start
            row = {"span_s": span, "mb_per_s": m / span, "bubble_mean": sum(best.bubbles()) / world,
                   "bubble_per_rank": best.bubbles(), "formula": bubble_formula(sched, world, m, v)}
            if sched in docs and m == 8 and rank == 0:
                render_png(best, ROOT / "docs" / f"pp_measured_{sched}.png",
                           f"measured {sched} (toy stages, F = {1000 * t / v:.0f} ms per chunk): p={world}, m=8"
                           + (f", v={v}" if v > 1 else ""))
                row["text"] = render_text(best)
            out[f"{sched}/m{m}"] = row
    return out


def _memory(rank: int, world: int, m_values: list[int], scheds) -> dict:
    from ndtrain.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainingConfig
    from ndtrain.mesh import ParallelDims
    from ndtrain.train.loop import Trainer

    torch.set_num_threads(1)
    mesh = ParallelDims(pp=world, world_size=world).build_mesh()
    out = {}
    for sched, v in scheds:
        for m in _ms(sched, m_values):
            cfg = Config(model=ModelConfig(vocab_size=256, dim=128, n_layers=8, n_heads=4, ffn_hidden=344,
                                           max_seq_len=128, rope_theta=10000.0),
                         data=DataConfig(seq_len=128),
                         training=TrainingConfig(dtype="float32", global_batch_size=m, micro_batch_size=1),
                         parallel=ParallelConfig(pp=world, pp_schedule=sched,
                                                 pp_virtual_stages=v if sched == "interleaved" else 1,
                                                 pp_microbatches=m))
            tr = Trainer(cfg, mesh, torch.device("cpu"))
            tr.measure_memory = True  # the step meters live activation storages per stage
            g = torch.Generator().manual_seed(0)
            x = torch.randint(0, 256, (m, 128), generator=g)
            times = []
            for _ in range(2):
                t0 = time.perf_counter()
                tr.step(x, x)
                times.append(time.perf_counter() - t0)
            out[f"{sched}/m{m}"] = {"peak_act_bytes": tr.pipeline.runtime.peak_activation_bytes,
                                    "step_s": min(times)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,2,4,8,16")
    ap.add_argument("--t", type=float, default=0.01, help="toy F time per rank share, seconds")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--docs", action="store_true", help="write timeline PNGs into docs/")
    ap.add_argument("--scheds", default="", help="comma-separated subset (merged into the existing JSON)")
    args = ap.parse_args()
    ms = [int(x) for x in args.ms.split(",")]
    scheds = tuple(sv for sv in SCHEDS if not args.scheds or sv[0] in args.scheds.split(","))
    out = ROOT / "bench" / "results" / "pp_throughput.json"
    res = {"p": P, "t_s": args.t, "machine": "CPU, gloo, 4 local processes"}
    if args.scheds and out.exists():
        res = json.loads(out.read_text())

    docs = {s for s, _ in scheds} if args.docs else set()  # PNGs of the requested schedules only
    if not any(s == "gpipe" for s, _ in scheds):  # the ratio to GPipe needs its rows
        scheds = (("gpipe", 1),) + scheds
    toy = run_ranks(_toy, P, ms, args.t, args.steps, docs, scheds, timeout_s=1200)[0]
    ideal = 1.0 / (3 * args.t)  # microbatches / s with no bubble: each rank works 3 t per microbatch
    print(f"A. toy pipeline, p={P}, F={1000 * args.t:.0f} ms, B=2F: microbatches/s (ratio to bubble-free "
          f"{ideal:.1f}/s; idle measured vs formula)")
    print(f"{'m':>4} " + " ".join(f"{s:>30}" for s, _ in scheds))
    for m in ms:
        cells = []
        for s, _ in scheds:
            r = toy.get(f"{s}/m{m}")
            if r is None:
                cells.append("-")
                continue
            r["ratio_to_ideal"] = r["mb_per_s"] / ideal
            r["ratio_to_gpipe"] = r["mb_per_s"] / toy[f"gpipe/m{m}"]["mb_per_s"]
            cells.append(f"{r['mb_per_s']:6.1f} ({r['ratio_to_ideal']:.2f}) {100 * r['bubble_mean']:4.1f}%"
                         f"/{100 * r['formula']:4.1f}%")
        print(f"{m:>4} " + " ".join(f"{c:>30}" for c in cells))
    res.setdefault("toy", {}).update({k: {kk: vv for kk, vv in v.items() if kk != "text"} for k, v in toy.items()})
    for s, _ in scheds:
        if "text" in toy.get(f"{s}/m8", {}):
            print(toy[f"{s}/m8"]["text"])
            res.setdefault("timelines_text", {})[s] = toy[f"{s}/m8"]["text"]

    if not any(s == "1f1b" for s, _ in scheds):  # DualPipeV's memory unit is 1F1B's m = 1 peak
        scheds = scheds + (("1f1b", 1),)
    mem = run_ranks(_memory, P, [1, 8], scheds, timeout_s=1200)
    print("B. peak activation bytes per stage, tiny Transformer (dim 128, 8 layers, T 128, mb 1), m = 8"
          " (ratio to the same stage with m = 1)")
    res.setdefault("memory", {})
    for s, _ in scheds:
        row = [mem[r][f"{s}/m8"]["peak_act_bytes"] for r in range(P)]
        unit = [mem[r][f"{s if s != 'dualpipev' else '1f1b'}/m1"]["peak_act_bytes"] for r in range(P)]
        ratio = [a / b for a, b in zip(row, unit)]
        res["memory"][s] = {"peak_act_bytes_m8": row, "peak_act_bytes_m1": unit, "ratio": ratio,
                            "step_s_m8": [mem[r][f"{s}/m8"]["step_s"] for r in range(P)]}
        print(f"{s:>12}: " + "  ".join(f"rank {r}: {row[r] / 2**20:6.2f} MiB ({ratio[r]:.1f}x)" for r in range(P)))

    if args.docs:
        from ndtrain.parallel.pp.viz import planned_timeline, render_png

        for s, v in (sv for sv in scheds if sv[0] in docs):
            render_png(planned_timeline(s, P, 8, v), ROOT / "docs" / f"pp_planned_{s}.png")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
