"""Check the planner against real ``ndtrain train`` runs: peak memory per rank and step time.

``compare_with_runs(run_dirs)`` reads each ``RUN_DIR/config.yaml`` (the resolved config the trainer
writes) and ``RUN_DIR/metrics.jsonl``, predicts with the eager model of what the trainer holds
(``planner.eager``: model state per ZeRO stage in the trainer's dtypes, activations tensor by
tensor) and returns one row per run with the relative errors. Two memory quantities:

* ``metered``: model state + activations, the bytes of live tensors. Measured by the trainer's
  meters on its first step (``mem_state_peak_bytes`` + ``mem_activations_peak_bytes``, see
  ``ndtrain.mem_account``), the CPU counterpart of CUDA's ``max_memory_allocated``. Predicted by
  ``estimate_trainer_state_bytes`` + ``estimate_eager_activation_peak``.
* ``rss``: the process's max resident set (``peak_mem_bytes``: what ``ndtrain train`` logs on CPU,
  max over ranks). Predicted as ``baseline_bytes`` (``measure_eager.measure_trainer_baseline_rss``: the
  interpreter, torch, thread pools, the trainer around a negligible model) + the live peak (the
  metered sum, or state + the transient data-parallel / optimizer buffers when larger). glibc's
  malloc keeps freed heap memory (its mmap threshold grows with the largest freed block), which
  this does not model: compare with runs under ``MALLOC_MMAP_THRESHOLD_`` fixed, or read the
  error as that retention.

Step time: with ``rates`` (``measure_eager.measure_eager_rates`` for the layout's threads and ranks) and
gloo ``comm`` (``measure.measure_collectives``), ``eager_time.estimate_eager_step_time``;
without, the GPU-style model of ``search.evaluate`` with the peak recovered from the run's own MFU.
The issue's targets: memory within 15%, step time within 30%.

    python -m ndtrain.calibration.calibrate RUN_DIR [RUN_DIR ...] [--world N] [--baseline-bytes B]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from ndtrain.calibration.eager_time import estimate_eager_step_time
from ndtrain.planner.eager import (
    estimate_eager_activation_peak,
    estimate_trainer_state_bytes,
    padded_shard_numel,
    param_shapes,
)
from ndtrain.planner.hardware import Cluster, get_accelerator
from ndtrain.planner.layout import Layout, Workload
from ndtrain.planner.model_spec import from_model_config
from ndtrain.planner.search import evaluate

ACT_BYTES = {"bfloat16": 2, "float32": 4, "float64": 8}


def load_run(run_dir):
    """(config, metric rows with ``step_time_s``) of a run directory; raises FileNotFoundError."""
    import yaml

    from ndtrain.config import config_from_dict

    run = Path(run_dir)
    cfg = config_from_dict(yaml.safe_load((run / "config.yaml").read_text()))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return cfg, [r for r in rows if "step_time_s" in r]


def trainer_layout(cfg, world: int | None = None) -> Layout:
    """The planner's ``Layout`` of a trainer config (``dp_shard=-1`` resolved with ``world``)."""
    p, t = cfg.parallel, cfg.training
    fixed = p.pp * p.dp_replicate * p.cp * p.tp
    dp_shard = p.dp_shard if p.dp_shard != -1 else max(1, (world or fixed) // fixed)
    local = max(1, t.global_batch_size // (dp_shard * p.dp_replicate))
    return Layout(tp=p.tp, cp=p.cp, pp=p.pp, dp_shard=dp_shard, dp_replicate=p.dp_replicate, ep=p.ep,
                  zero_stage=p.zero_stage, ac=t.activation_checkpoint, microbatch=t.micro_batch_size or local,
                  pp_schedule=p.pp_schedule, pp_virtual_stages=p.pp_virtual_stages if p.pp_schedule == "interleaved" else 1,
                  sp=int(p.sequence_parallel), cp_impl=p.cp_impl,
                  # the trainer's expert_tp = tp is the planner's tied mesh (experts split by the attention
                  # tp); any other (1: whole experts on each tp rank) is an expert_tp of its own
                  expert_tp=-1 if p.expert_tp == p.tp else p.expert_tp, edp=getattr(p, "edp", 0))


def predict_memory(cfg, world: int | None = None, baseline_bytes: float = 0.0, hooks_sampled: bool = True) -> dict:
    """Per-rank bytes of a data-parallel / ZeRO / HSDP run of ``cfg`` (see the module docstring):
    ``state`` (params / grads / optim / total), ``activations`` (peak, at), ``metered``, ``live``,
    ``rss`` and a ``breakdown`` summing to ``rss``. TP / CP / PP / EP layouts: ``planner.eager_axes``
    (plain DDP, fp32 / fp64, ac=none). Raises ValueError for a model or policy the eager models do
    not cover."""
    lay = trainer_layout(cfg, world)
    if lay.tp * lay.cp * lay.pp * lay.ep > 1:
        return _predict_axes_memory(cfg, lay, baseline_bytes)
    spec, t, dtype = from_model_config(cfg.model), cfg.training, cfg.training.dtype
    n_micro = max(1, t.global_batch_size // (lay.dp * lay.microbatch))
    state = estimate_trainer_state_bytes(spec, lay.zero_stage, lay.dp_shard, dtype,
                                         cfg.parallel.bucket_size_bytes, hooks_sampled, n_micro)
    act = estimate_eager_activation_peak(spec, lay.microbatch, cfg.data.seq_len, dtype, lay.ac, lay.zero_stage)
    m, c = (8 if dtype == "float64" else 4), (2 if dtype in ("bfloat16", "float16") else (8 if dtype == "float64" else 4))
    shapes = [s for _, s in param_shapes(spec)]
    psi = sum(_numel(s) for s in shapes)
    # ZeRO-3 keeps the head unit and the prefetched last block gathered around the activation peak
    z3 = c * (spec.vocab_size * spec.dim + spec.dim + spec.layer_params(False)) \
        if lay.zero_stage == 3 and lay.dp_shard > 1 else 0
    # with one microbatch the activation peak comes before any gradient exists (step >= 2)
    grads_then = state["grads"] if n_micro >= 2 else 0
    candidates = {"activations": state["total"] - state["grads"] + grads_then + act["peak"] + z3,
                  "optimizer_temporaries": state["total"] + m * (padded_shard_numel(shapes, lay.dp_shard)
                                                                 if lay.zero_stage else psi)}
    if lay.zero_stage == 0 and lay.dp > 1:  # every bucket's flat gradient copy at the end of backward
        candidates["ddp_buckets"] = state["total"] + m * psi
    live_at = max(candidates, key=candidates.get)
    live = candidates[live_at]
    bd = {"params": state["params"], "grads": state["grads"], "optimizer": state["optim"],
          "activations": live - state["total"], "baseline": baseline_bytes}
    return {"state": state, "activations": act, "metered": state["total"] + act["peak"], "live": live,
            "live_at": live_at, "rss": baseline_bytes + live, "breakdown": bd, "layout": lay,
            "n_micro": n_micro, "spec": spec}


def _predict_axes_memory(cfg, lay, baseline_bytes: float) -> dict:
    """``predict_memory`` for TP / CP / PP / EP layouts (``planner.eager_axes``, rank 0: the rank
    whose meters the trainer logs; on a pipeline the first stage, which holds the most
    microbatches)."""
    from ndtrain.calibration.eager_axes import estimate_axes_activation_peak, estimate_axes_state_bytes

    spec = from_model_config(cfg.model)
    state = estimate_axes_state_bytes(spec, cfg)
    act = estimate_axes_activation_peak(spec, cfg, 0, lay.dp)
    act["at"] = f"{act['schedule']} schedule replay"
    live = state["total"] + act["peak"]
    bd = {"params": state["params"], "grads": state["grads"], "optimizer": state["optim"],
          "activations": act["peak"], "baseline": baseline_bytes}
    n_micro = max(1, cfg.training.global_batch_size // (lay.dp * lay.microbatch))
    return {"state": state, "activations": act, "metered": live, "live": live, "live_at": "activations",
            "rss": baseline_bytes + live, "breakdown": bd, "layout": lay, "n_micro": n_micro, "spec": spec}


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def measured_from_rows(rows: list[dict], skip_first: int = 1) -> dict:
    """``metered`` (state + activation peaks of the first logged row: the metered step when it is
    step 1), ``rss`` (max ``peak_mem_bytes``) and ``step_s`` (median after ``skip_first`` rows)."""
    first = rows[0]
    metered = None
    if "mem_state_peak_bytes" in first:
        metered = first["mem_state_peak_bytes"] + first.get("mem_activations_peak_bytes", 0)
    timed = rows[skip_first:] or rows
    return {"metered": metered, "rss": max(r.get("peak_mem_bytes", 0) for r in rows),
            "step_s": statistics.median(r["step_time_s"] for r in timed), "first_step": first.get("step")}


def compare_with_runs(run_dirs, world: int | None = None, baseline_bytes: float = 0.0, accelerator=None,
                      skip_first: int = 1, rates: dict | None = None, comm: dict | None = None) -> list[dict]:
    """One dict per run: layout, predicted / measured memory (``metered`` and RSS) and step time,
    relative errors (``mem_rel_err`` is the RSS one). ``world`` (processes of runs with
    ``dp_shard=-1``), ``baseline_bytes`` and ``rates`` (measured eager rates) are one value for all
    runs or a dict keyed by run dir (str); ``comm`` has ``alpha_s`` and ``beta_bytes_per_s``
    (``measure.measure_collectives``) and optionally ``sync_alpha_s`` (``measure.measure_sync_latency``:
    the per-ring-step cost of a blocking collective between computing ranks), which then replaces
    ``alpha_s`` for every layout. Raises FileNotFoundError / ValueError for a missing or empty run."""
    def per_run(value, key):
        return value.get(key) if isinstance(value, dict) and key in value else value

    comm = comm or {}
    alpha, beta = comm.get("sync_alpha_s", comm.get("alpha_s", 0.0)), comm.get("beta_bytes_per_s", float("inf"))
    out = []
    for run_dir in run_dirs:
        cfg, rows = load_run(run_dir)
        if not rows:
            raise ValueError(f"{run_dir}: metrics.jsonl has no step_time_s rows")
        meas = measured_from_rows(rows, skip_first)
        pred = predict_memory(cfg, per_run(world, str(run_dir)), per_run(baseline_bytes, str(run_dir)),
                              hooks_sampled=meas["first_step"] == 1)
        lay, spec = pred["layout"], pred["spec"]
        r = per_run(rates, str(run_dir))
        if r and lay.tp * lay.cp * lay.pp * lay.ep > 1:
            from ndtrain.calibration.eager_axes_time import estimate_axes_step_time

            step = estimate_axes_step_time(spec, cfg, r, lay.world, alpha, beta)
            step_s, step_parts = step["step_time_s"], step["parts"]
        elif r:
            step = estimate_eager_step_time(
                spec, lay.microbatch, cfg.data.seq_len, pred["n_micro"], r, lay.zero_stage, lay.dp_shard,
                lay.dp_replicate, cfg.training.dtype, lay.ac, alpha, beta, cfg.parallel.bucket_size_bytes)
            step_s, step_parts = step["step_time_s"], step["parts"]
        else:
            step_s, step_parts = _gpu_style_step(cfg, spec, lay, rows, skip_first, accelerator)
        row = {"run": str(run_dir), "layout": lay.short(), "world": lay.world,
               "predicted_metered_bytes": pred["metered"], "measured_metered_bytes": meas["metered"],
               "metered_rel_err": pred["metered"] / meas["metered"] - 1 if meas["metered"] else None,
               "predicted_mem_bytes": pred["rss"], "measured_mem_bytes": meas["rss"],
               "mem_rel_err": pred["rss"] / meas["rss"] - 1 if meas["rss"] else None,
               "predicted_step_s": step_s, "measured_step_s": meas["step_s"],
               "step_rel_err": step_s / meas["step_s"] - 1, "step_breakdown_s": step_parts,
               "memory_breakdown_bytes": pred["breakdown"], "activation_peak_at": pred["activations"]["at"],
               "live_peak_at": pred["live_at"]}
        out.append(row)
    return out


def _gpu_style_step(cfg, spec, lay, rows, skip_first, accelerator):
    """The datasheet model of ``search.evaluate`` with the run's own peak (from its MFU)."""
    t, T = cfg.training, cfg.data.seq_len
    w = Workload(seq_len=T, global_batch_tokens=t.global_batch_size * T, train_tokens=t.steps * t.global_batch_size * T,
                 precision="fp64" if t.dtype == "float64" else "fp32", act_bytes=ACT_BYTES.get(t.dtype, 4))
    acc = accelerator or get_accelerator("cpu")
    with_mfu = [r for r in (rows[skip_first:] or rows) if r.get("mfu")]
    dtype = "bfloat16" if w.act_bytes == 2 else "float32"
    if with_mfu and accelerator is None:
        r = with_mfu[-1]
        peak = spec.flops_per_token(T) * r["tokens_per_s"] / (r["mfu"] * lay.world)
        acc = replace(acc, peak_flops_per_s={**acc.peak_flops_per_s, dtype: peak})
    acc = replace(acc, runtime_reserve_bytes=0.0, hbm_bytes=max(acc.hbm_bytes, 1 << 40))
    plan = evaluate(spec, Cluster(acc, lay.world, lay.world, dtype=dtype), w, lay)
    if plan.errors:
        raise ValueError("; ".join(plan.errors))
    return plan.step.step_time_s, plan.step.parts


def format_comparison(rows: list[dict]) -> str:
    """A fixed-width table: memory (metered and RSS, MiB) and step time, predicted / measured."""
    head = (f"{'run':<22} {'layout':<24} {'state+act pred':>14} {'meas':>7} {'err':>6} "
            f"{'RSS pred':>9} {'meas':>7} {'err':>6} {'step pred':>9} {'meas':>7} {'err':>6}")
    lines = [head, "-" * len(head)]
    mib = 2**20
    for r in rows:
        met = r["measured_metered_bytes"]
        lines.append(
            f"{Path(r['run']).name[:22]:<22} {r['layout'][:24]:<24} {r['predicted_metered_bytes'] / mib:13.1f}M "
            + (f"{met / mib:6.1f}M {r['metered_rel_err']:+6.1%} " if met else f"{'-':>7} {'-':>6} ")
            + f"{r['predicted_mem_bytes'] / mib:8.0f}M {r['measured_mem_bytes'] / mib:6.0f}M {r['mem_rel_err']:+6.1%} "
            f"{r['predicted_step_s']:8.2f}s {r['measured_step_s']:6.2f}s {r['step_rel_err']:+6.1%}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ndtrain.calibration.calibrate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dirs", nargs="+")
    ap.add_argument("--world", type=int, default=None, help="processes of runs with dp_shard=-1")
    ap.add_argument("--baseline-bytes", type=float, default=None,
                    help="process baseline (default: measure_trainer_baseline_rss for the first run)")
    args = ap.parse_args(argv)
    base = args.baseline_bytes
    if base is None:
        from ndtrain.calibration.measure_eager import measure_trainer_baseline_rss

        cfg, _ = load_run(args.run_dirs[0])
        base = measure_trainer_baseline_rss(cfg, args.world or 1)
    print(format_comparison(compare_with_runs(args.run_dirs, args.world, base)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
