"""Planner vs real ``ndtrain train`` runs on this machine: per-rank memory and step time.

    python bench/planner_calibration.py [--steps 12] [--rounds 2] [--layouts single,ddp2,tp2,pp2_1f1b,...]

A small Llama (dim 384, 6 layers, 6 heads / 2 kv heads, SwiGLU 1024, vocab 512 untied, T = 256,
9.8M parameters, fp32) on this interpreter's standard library (byte tokenizer), 8 sequences per
step in microbatches of 2, one thread per rank (1 or 2 ranks on this 2-core machine). For each
layout, in one command:

1. ``measure_trainer_baseline_rss``: RSS of the same ranks around a negligible model;
2. ``measure_eager_rates`` (the model's matmuls and components timed at the run's shapes with the
   run's threads and concurrent ranks), right before and right after the run (the mean is used:
   other jobs share the cores);
3. ``ndtrain train`` for ``--steps`` steps (log every step; step 1 is metered), and a 3-step run of
   the same layout with ``MALLOC_MMAP_THRESHOLD_`` fixed (glibc then returns freed blocks, so its
   max RSS is the live peak plus the baseline: the CPU analogue of CUDA's allocated memory);
4. the planner's predictions (``planner.calibrate.compare_with_runs``).

Gloo's alpha / beta are measured once (``measure_collectives``), and the cost of a blocking
collective between computing ranks (``measure_sync_latency``), which the step-time models use as
alpha for every layout. Prints the table and writes
``bench/results/planner_calibration.json``. Measured step time = median of steps 3.. (step 1 runs
the memory meters, step 2 warms up).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ndtrain.calibration.calibrate import compare_with_runs, format_comparison, load_run, predict_memory
from ndtrain.calibration.eager_axes_time import axis_collective_gap, rate_spec
from ndtrain.calibration.measure import measure_collectives, measure_matmul_flops, measure_sync_latency
from ndtrain.calibration.measure_eager import measure_eager_rates, measure_trainer_baseline_rss
from ndtrain.calibration.measure_ep import measure_ep_imbalance
from ndtrain.config import load_config
from ndtrain.planner.model_spec import from_model_config

MODEL = {"model.vocab_size": 512, "model.dim": 384, "model.n_layers": 6, "model.n_heads": 6,
         "model.n_kv_heads": 2, "model.ffn_hidden": 1024, "model.max_seq_len": 256,
         "model.tie_embeddings": False, "data.source": "stdlib", "data.tokenizer": "bytes",
         "data.seq_len": 256, "data.max_corpus_bytes": 2_000_000, "training.dtype": "float32",
         "training.global_batch_size": 8, "training.micro_batch_size": 2, "training.warmup_steps": 2,
         "training.eval_every": 0, "training.eval_batches": 1, "training.sample_every": 0,
         "training.sample_tokens": 0, "checkpoint.every": 0, "logging.log_every": 1,
         "logging.plot": False}
LAYOUTS = {  # name: (processes, overrides)
    "single": (1, {}),
    "ddp2": (2, {}),
    "zero1x2": (2, {"parallel.zero_stage": 1}),
    "zero3x2": (2, {"parallel.zero_stage": 3}),
    "ac_full": (1, {"training.activation_checkpoint": "full"}),
    "tp2": (2, {"parallel.tp": 2}),
    "cp2": (2, {"parallel.cp": 2}),
    "pp2_gpipe": (2, {"parallel.pp": 2, "parallel.pp_schedule": "gpipe"}),
    "pp2_1f1b": (2, {"parallel.pp": 2, "parallel.pp_schedule": "1f1b"}),
    "pp2_interleaved": (2, {"parallel.pp": 2, "parallel.pp_schedule": "interleaved", "parallel.pp_virtual_stages": 2}),
    "pp2_zero_bubble": (2, {"parallel.pp": 2, "parallel.pp_schedule": "zero_bubble"}),
    "ep2": (2, {"parallel.ep": 2, "model.moe_experts": 4, "model.moe_top_k": 2, "model.moe_ffn_hidden": 512}),
}


def _overrides(extra: dict, steps: int) -> list[str]:
    return [f"--{k}={v}" for k, v in {**MODEL, **extra, "training.steps": steps}.items()]


def _train(run_dir: Path, nproc: int, extra: dict, steps: int, env: dict) -> float:
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "ndtrain.cli.commands", "train", "--config", "debug", "--nproc", str(nproc),
           "--run-dir", str(run_dir)] + _overrides(extra, steps)
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if res.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    return time.perf_counter() - t0


def _rates(rspec, lcfg, mb: int, t_local: int, nproc: int, moe) -> dict:
    """``measure_eager_rates`` at one rank's shapes, and for each axis with blocking collectives in
    the step (tp, cp, ep) the cost of one of them at the layout's message size and compute gap
    (``<axis>_collective_s``, ``measure_sync_latency``; ``<axis>_gap_s`` the gap asked for,
    ``<axis>_gap_measured_s`` the loop's)."""
    p = lcfg.parallel
    rates = measure_eager_rates(rspec, mb, t_local, 1, nproc, cp=p.cp, moe_model=moe, tp=p.tp, ep=p.ep)
    for axis in ("tp", "cp", "ep"):
        if getattr(p, axis) > 1:
            where = axis_collective_gap(from_model_config(lcfg.model), lcfg, rates, axis)
            sync = measure_sync_latency(world=nproc, nbytes=where["nbytes"], gap_s=where["gap_s"])
            rates.update({f"{axis}_collective_s": sync["per_collective_s"], f"{axis}_gap_s": where["gap_s"],
                          f"{axis}_gap_measured_s": sync["gap_measured_s"]})
    return rates


def _busy_and_wait(runs: list, per_run: list) -> dict:
    """Measured: the median over timed steps of the slowest rank's busy time (its step minus its
    waits in collectives and pipeline receives: the trainer's flight recorder) and the rest of
    the step, and the ranks' mean busy time (what the compute parts predict when the ranks' work
    differs, as under skewed EP routing); predicted: the parts that compute and those that wait
    (communication, bubble, the wait for the busiest EP rank)."""
    busy, wait, mean_busy = [], [], []
    for run in runs:
        for r in load_run(run)[1][2:]:
            if r.get("per_rank"):
                b = max(x[2] for x in r["per_rank"])
                busy.append(b)
                wait.append(r["step_time_s"] - b)
                mean_busy.append(statistics.fmean(x[2] for x in r["per_rank"]))
    waits = [sum(v for k, v in r["step_breakdown_s"].items() if k.endswith("comm") or k in ("bubble", "ep_imbalance"))
             for r in per_run]
    comp = [r["predicted_step_s"] - w for r, w in zip(per_run, waits)]
    return {"measured_busy_s": statistics.median(busy) if busy else None,
            "measured_busy_mean_s": statistics.median(mean_busy) if mean_busy else None,
            "measured_wait_s": statistics.median(wait) if wait else None,
            "predicted_compute_s": statistics.fmean(comp), "predicted_wait_s": statistics.fmean(waits)}


def _mean(a: dict, b: dict) -> dict:
    return {k: (a[k] + b[k]) / 2 if isinstance(a[k], float) else a[k] for k in a}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2, help="runs per layout, layouts alternating")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "planner_calibration.json"))
    ap.add_argument("--runs", default="/tmp/ndtrain_planner_calibration", help="run directories go here")
    args = ap.parse_args(argv)
    names = args.layouts.split(",")
    root = Path(args.runs) / time.strftime("%Y%m%d-%H%M%S")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env_rss = dict(env, MALLOC_MMAP_THRESHOLD_="131072")
    base_cfg = load_config("debug", {k: v for k, v in MODEL.items()}, world_size=1)
    from ndtrain.data import prepare_data

    prepare_data(base_cfg.data, base_cfg.model.vocab_size)  # cached before any timing
    comm = measure_collectives(world=2, sizes=(2**16, 2**20, 2**22, 2**24), reps=5)
    sync = measure_sync_latency(world=2)
    comm.update(sync_alpha_s=sync["alpha_s"], sync_per_collective_s=sync["per_collective_s"])
    import torch

    torch.set_num_threads(1)  # the ranks' threads
    mm = measure_matmul_flops(sizes=(512, 1024), seconds=0.3)
    print(f"gloo: alpha {comm['alpha_s'] * 1e6:.0f} us (idle), {comm['sync_alpha_s'] * 1e6:.0f} us (between "
          f"computing ranks), beta {comm['beta_bytes_per_s'] / 1e9:.2f} GB/s; "
          f"square matmul (1 thread) {mm['peak'] / 1e9:.0f} GFLOP/s", flush=True)
    worlds, bases, rates, info = {}, {}, {}, {n: {"runs": [], "rates": []} for n in names}
    for name in names:  # the baseline once per layout
        nproc, extra = LAYOUTS[name]
        info[name]["baseline_bytes"] = measure_trainer_baseline_rss(
            load_config("debug", {**MODEL, **extra}, world_size=nproc), nproc, threads=1)
    for rnd in range(args.rounds):  # layouts alternate, so slow phases of other jobs hit all of them
        for name in names:
            nproc, extra = LAYOUTS[name]
            mb, T = MODEL["training.micro_batch_size"], MODEL["data.seq_len"]
            run = root / f"{name}-r{rnd}"
            lcfg = load_config("debug", {**MODEL, **extra}, world_size=nproc)
            rspec = rate_spec(from_model_config(lcfg.model), lcfg)  # one rank's local shapes
            cp = lcfg.parallel.cp
            moe = dataclasses.asdict(lcfg.model) if lcfg.model.moe_experts else None
            before = _rates(rspec, lcfg, mb, T // cp, nproc, moe)
            wall = _train(run, nproc, extra, args.steps, env)
            after = _rates(rspec, lcfg, mb, T // cp, nproc, moe)
            runs_here = [run]
            if rnd == 0:  # RSS with glibc returning freed blocks (short run)
                runs_here.append(root / f"{name}-rss")
                _train(runs_here[-1], nproc, extra, 3, env_rss)
            for r in runs_here:
                worlds[str(r)], bases[str(r)] = nproc, info[name]["baseline_bytes"]
            rates[str(run)] = _mean(before, after)
            if lcfg.parallel.ep > 1:  # the run's routing skew, replayed in one process (measure_ep)
                lcfg.training.steps = args.steps
                imb = measure_ep_imbalance(lcfg, nproc, skip_first=2)
                rates[str(run)]["moe_imbalance"] = imb["moe_imbalance"]
                info[name].setdefault("moe_imbalance_per_step", []).append(imb["per_step"])
            info[name]["runs"].append(str(run))
            info[name]["rates"] += [before, after]
            info[name].setdefault("load_avg_1min", []).append(os.getloadavg()[0])
            tp_sync = "".join(f", {a} collective at a {before[a + '_gap_s'] * 1e3:.1f} ms gap "
                              f"{before[a + '_collective_s'] * 1e3:.2f} -> {after[a + '_collective_s'] * 1e3:.2f} ms"
                              for a in ("tp", "cp", "ep") if a + "_collective_s" in before)
            if "moe_imbalance" in rates[str(run)]:
                tp_sync += (f", ep experts {before['moe_experts_s'] * 1e3:.1f} ms of the MoE layer's "
                            f"{before['moe_mlp_s'] * 1e3:.1f} ms, routing skew {rates[str(run)]['moe_imbalance']:.2f}")
            print(f"{name} (round {rnd}): {wall:.0f} s, load {os.getloadavg()[0]:.1f}, matmul at the model's shapes "
                  f"{before['gemm_flops_per_s'] / 1e9:.0f} -> {after['gemm_flops_per_s'] / 1e9:.0f} GFLOP/s{tp_sync}",
                  flush=True)
    rows = []
    for name in names:  # memory from round 0; step time: mean prediction vs median of all timed steps
        per_run = compare_with_runs(info[name]["runs"], worlds, bases, skip_first=2, rates=rates, comm=comm)
        row = dict(per_run[0], run=name)
        steps = [r["step_time_s"] for run in info[name]["runs"] for r in load_run(run)[1][2:]]
        row["measured_step_s"] = statistics.median(steps)
        row["predicted_step_s"] = statistics.fmean(r["predicted_step_s"] for r in per_run)
        row["step_rel_err"] = row["predicted_step_s"] / row["measured_step_s"] - 1
        row["per_round"] = [{k: r[k] for k in ("predicted_step_s", "measured_step_s", "step_rel_err")}
                            for r in per_run]
        row.update(_busy_and_wait(info[name]["runs"], per_run))
        _, rr = load_run(root / f"{name}-rss")
        rss = max(r["peak_mem_bytes"] for r in rr)
        row.update(measured_rss_fixed_threshold_bytes=rss, rss_fixed_rel_err=row["predicted_mem_bytes"] / rss - 1)
        g = statistics.fmean(x["gemm_flops_per_s"] for x in info[name]["rates"])
        info[name]["gemm_efficiency_vs_square_1024"] = g / mm["per_size"][1024]
        rows.append(row)
    table = format_comparison(rows)
    lines = [table, "", (f"{'layout':<10} {'RSS, fixed mmap threshold: pred':>32} {'meas':>7} {'err':>7}  "
                         "activation peak at / live peak at / step error per round")]
    for name, row in zip(names, rows):
        lines.append(f"{name:<10} {row['predicted_mem_bytes'] / 2**20:31.0f}M "
                     f"{row['measured_rss_fixed_threshold_bytes'] / 2**20:6.0f}M {row['rss_fixed_rel_err']:+7.1%}  "
                     f"{row['activation_peak_at']} / {row['live_peak_at']} / "
                     + ", ".join(f"{r['step_rel_err']:+.0%}" for r in row["per_round"]))
    lines.append(f"\n{'layout':<16} {'compute: pred':>13} {'busy meas':>9} {'(rank mean)':>11} {'wait: pred':>10} "
                 f"{'meas':>6}")
    for name, row in zip(names, rows):
        b, bm, w = row["measured_busy_s"], row["measured_busy_mean_s"], row["measured_wait_s"]
        lines.append(f"{name:<16} {row['predicted_compute_s']:12.2f}s " + (f"{b:8.2f}s" if b else f"{'-':>9}")
                     + (f" {bm:10.2f}s" if bm else f" {'-':>11}")
                     + f" {row['predicted_wait_s']:9.2f}s " + (f"{w:5.2f}s" if w is not None else f"{'-':>6}"))
    print("\n".join(lines))
    out = {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "model": MODEL, "steps": args.steps, "rounds": args.rounds, "threads_per_rank": 1, "comm": comm,
           "matmul_peak_flops_per_s": mm["peak"], "layouts": names, "rows": rows, "details": info,
           "predicted_memory": {n: {k: v for k, v in predict_memory(load_run(r)[0], worlds[str(r)],
                                                                     bases[str(r)]).items()
                                    if k in ("state", "metered", "live", "rss", "breakdown")}
                                for n, r in ((n, info[n]["runs"][0]) for n in names)}}
    out["predicted_memory"] = json.loads(json.dumps(out["predicted_memory"], default=str))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
