"""Check the planner against real ``ndtrain train`` runs: peak memory per rank and step time.

``compare_with_runs(run_dirs)`` reads each ``RUN_DIR/config.yaml`` (the resolved config the trainer
writes) and ``RUN_DIR/metrics.jsonl`` (``step_time_s``, ``peak_mem_bytes``, ``tokens_per_s``,
``mfu``), rebuilds the model spec, workload and layout, predicts with the ``cpu`` table entry (or a
given accelerator), and returns one row per run with the relative errors. The issue's targets:
memory within 15%, step time within 30%.

Conventions for ndtrain runs: weights and gradients are fp32 (the trainer's master copy; bf16 runs
autocast), so precision ``fp32`` (4 + 4 + 8 bytes/param); activations take 2 bytes under bf16
autocast, else the parameter dtype's size. On CPU the measured peak is the process's max RSS, which
includes the interpreter, torch and the data pipeline: pass ``baseline_bytes`` (``measure.
measure_baseline_rss()``) as the runtime reserve. The peak FLOP/s is recovered from the run itself
(tokens/s x FLOPs/token / (MFU x world)), the same number the trainer's MFU used.

    python -m ndtrain.planner.calibrate RUN_DIR [RUN_DIR ...] [--world N] [--baseline-bytes B]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from ndtrain.planner.hardware import Cluster, get_accelerator
from ndtrain.planner.layout import Layout, Workload
from ndtrain.planner.model_spec import from_model_config
from ndtrain.planner.search import evaluate

ACT_BYTES = {"bfloat16": 2, "float32": 4, "float64": 8}


def run_inputs(run_dir, world: int | None = None):
    """(spec, workload, layout, metrics rows) of one run directory; raises FileNotFoundError."""
    import yaml

    from ndtrain.config import config_from_dict

    run = Path(run_dir)
    cfg = config_from_dict(yaml.safe_load((run / "config.yaml").read_text()))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "step_time_s" in r]
    p, t, T = cfg.parallel, cfg.training, cfg.data.seq_len
    fixed = p.pp * p.dp_replicate * p.cp * p.tp
    dp_shard = p.dp_shard if p.dp_shard != -1 else max(1, (world or fixed) // fixed)
    dp = dp_shard * p.dp_replicate
    local = max(1, t.global_batch_size // dp)
    layout = Layout(tp=p.tp, cp=p.cp, pp=p.pp, dp_shard=dp_shard, dp_replicate=p.dp_replicate, ep=p.ep,
                    zero_stage=p.zero_stage, ac=t.activation_checkpoint,
                    microbatch=t.micro_batch_size or local,
                    schedule=p.pp_schedule, v=p.pp_virtual_stages if p.pp_schedule == "interleaved" else 1,
                    sp=int(p.sequence_parallel), cp_impl=p.cp_impl)
    w = Workload(seq_len=T, global_batch_tokens=t.global_batch_size * T,
                 train_tokens=t.steps * t.global_batch_size * T,
                 precision="fp64" if t.dtype == "float64" else "fp32",
                 act_bytes=ACT_BYTES.get(t.dtype, 4))
    return from_model_config(cfg.model, name=run.name), w, layout, rows


def compare_with_runs(run_dirs, world: int | None = None, baseline_bytes: float = 0.0,
                      accelerator=None, skip_first: int = 1) -> list[dict]:
    """One dict per run: layout, predicted / measured peak memory and step time, relative errors.

    ``skip_first`` logged rows are dropped from the step-time median (warm-up).
    """
    out = []
    for run_dir in run_dirs:
        spec, w, layout, rows = run_inputs(run_dir, world)
        if not rows:
            raise ValueError(f"{run_dir}: metrics.jsonl has no step_time_s rows")
        n = layout.world
        acc = accelerator or get_accelerator("cpu")
        timed = rows[skip_first:] or rows
        with_mfu = [r for r in timed if r.get("mfu")]
        if with_mfu and accelerator is None:
            r = with_mfu[-1]
            peak = spec.flops_per_token(w.seq_len) * r["tokens_per_s"] / (r["mfu"] * n)
            dtype = "bfloat16" if w.act_bytes == 2 else "float32"
            acc = replace(acc, peak_flops_per_s={**acc.peak_flops_per_s, dtype: peak})
        acc = replace(acc, runtime_reserve_bytes=baseline_bytes, hbm_bytes=max(acc.hbm_bytes, 1 << 40))
        cluster = Cluster(acc, n, n, dtype="bfloat16" if w.act_bytes == 2 else "float32")
        plan = evaluate(spec, cluster, w, layout)
        if plan.errors:
            raise ValueError(f"{run_dir}: {'; '.join(plan.errors)}")
        mem = max(r["peak_mem_bytes"] for r in rows if "peak_mem_bytes" in r)
        step = statistics.median(r["step_time_s"] for r in timed)
        out.append({"run": str(run_dir), "layout": layout.short(), "world": n,
                    "predicted_mem_bytes": plan.memory.total, "measured_mem_bytes": mem,
                    "mem_rel_err": plan.memory.total / mem - 1,
                    "predicted_step_s": plan.step.step_time_s, "measured_step_s": step,
                    "step_rel_err": plan.step.step_time_s / step - 1,
                    "memory_breakdown_bytes": plan.memory.breakdown})
    return out


def format_comparison(rows: list[dict]) -> str:
    head = f"{'run':<28} {'layout':<34} {'mem pred':>9} {'mem meas':>9} {'err':>6} " \
           f"{'step pred':>9} {'step meas':>9} {'err':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{Path(r['run']).name[:28]:<28} {r['layout'][:34]:<34} "
                     f"{r['predicted_mem_bytes'] / 2**20:8.0f}M {r['measured_mem_bytes'] / 2**20:8.0f}M "
                     f"{r['mem_rel_err']:+6.0%} {r['predicted_step_s']:9.3f} {r['measured_step_s']:9.3f} "
                     f"{r['step_rel_err']:+6.0%}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ndtrain.planner.calibrate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dirs", nargs="+")
    ap.add_argument("--world", type=int, default=None, help="processes of runs with dp_shard=-1")
    ap.add_argument("--baseline-bytes", type=float, default=None,
                    help="process baseline (default: measured RSS of a fresh interpreter importing torch)")
    args = ap.parse_args(argv)
    base = args.baseline_bytes
    if base is None:
        from ndtrain.planner.measure import measure_baseline_rss

        base = measure_baseline_rss()
    print(format_comparison(compare_with_runs(args.run_dirs, args.world, base)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
