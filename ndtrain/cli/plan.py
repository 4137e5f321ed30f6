"""``ndtrain plan``: predict memory, step time, MFU and training time; search or evaluate layouts.

    ndtrain plan --model PRESET_OR_CONFIG_JSON --hardware NAME --gpus N [--gpus-per-node 8]
                 [--seq-len T] [--global-batch-tokens B] [--train-tokens D] [--layout "tp=8,..."]
                 [--json] [--top N] [--report DIR] [--price-per-gpu-hour P] [--nodes K]
                 [--intra-node-gbps X] [--inter-node-gbps Y] [--pod-gpus G --inter-pod-gbps Z]
                 [--precision mixed|fp32|lower_bound] [--measure] [--include-unsupported]
                 [--moe-max-nodes M] [--moe-fp8-dispatch] [--moe-imbalance F]
                 [--mttf-hours H] [--checkpoint-save-s S] [--checkpoint-load-s S] [--restart-s S]
                 [--memory-model fused|trainer] [--rehearse K [--rehearse-cache DIR]]
                 [--mode compile|kernels|eager]

Without ``--layout`` it searches and recommends; with it, it evaluates that layout. ``--measure``
times this machine's matmul peak and gloo / NCCL all-reduce (alpha, beta) and, with ``--hardware
cpu`` (or no model), plans with the measured numbers. Bandwidths on the command line are GB/s per
GPU per direction. ``python -m ndtrain.cli.plan ...`` works without the main CLI.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import replace

from ndtrain.planner.hardware import HARDWARE, OVERRIDES, Cluster, apply_overrides, get_accelerator
from ndtrain.planner.layout import Workload, layout_assumptions, parse_layout


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``plan`` subcommand to ``subparsers``."""
    p = subparsers.add_parser("plan", help="plan a layout: memory, step time, MFU, training days",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_args(p)
    return p


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="ndtrain preset name / YAML path, or a Hugging Face config.json")
    p.add_argument("--hardware", default="H100", help=f"accelerator: {', '.join(HARDWARE)}")
    p.add_argument("--hardware-override", default="",
                   help='replace datasheet fields, e.g. "memory_gb=96,peak_tflops=989,inter_node_gbps=100" '
                        f"(keys: {', '.join(OVERRIDES)})")
    p.add_argument("--gpus", type=_count, default=None, help="accelerators in total")
    p.add_argument("--nodes", type=_count, default=None, help="alternative to --gpus: nodes x gpus-per-node")
    p.add_argument("--gpus-per-node", type=_count, default=0, help="default: the hardware's (8 for GPUs)")
    p.add_argument("--seq-len", type=_count, default=0, help="tokens per sequence T (default: the preset's)")
    p.add_argument("--global-batch-tokens", type=_positive, default=0,
                   help="tokens per optimizer step (default: the preset's batch, else 4M)")
    p.add_argument("--train-tokens", type=_positive, default=1e12, help="tokens to train on in total")
    p.add_argument("--layout", default="",
                   help='evaluate one layout, e.g. "tp=8,pp=16,dp_shard=64,zero_stage=1"')
    p.add_argument("--precision", default="mixed", help="bytes/param convention: mixed | fp32 | lower_bound")
    p.add_argument("--dtype", default="bfloat16", help="compute dtype whose peak is used")
    p.add_argument("--price-per-gpu-hour", type=_non_negative, default=2.0, help="dollars")
    p.add_argument("--efficiency", type=_positive, default=0.0, help="run every GEMM at this share of peak "
                   "(v1's flat model) instead of the per-operation compute model (planner/compute.py)")
    p.add_argument("--intra-node-gbps", type=_positive, default=0, help="override NVLink GB/s per direction")
    p.add_argument("--inter-node-gbps", type=_positive, default=0, help="override NIC GB/s per direction")
    p.add_argument("--pod-gpus", type=_count, default=0, help="GPUs per pod (0 = no pod level)")
    p.add_argument("--inter-pod-gbps", type=_positive, default=0, help="pod uplink GB/s per GPU per direction")
    p.add_argument("--top", type=_whole, default=10, help="layouts shown by the search (0: all)")
    p.add_argument("--json", action="store_true", help="print one JSON object per layout")
    p.add_argument("--report", default="", help="write plan.md, memory.png, timeline.png into this directory")
    p.add_argument("--include-unsupported", action="store_true",
                   help="also rank layouts ndtrain train rejects (marked '!', with the rule)")
    p.add_argument("--moe-max-nodes", type=int, default=0,
                   help="node-limited routing: a token's experts on at most this many nodes (DeepSeek-V3: 4)")
    p.add_argument("--moe-fp8-dispatch", action="store_true", help="dispatch all-to-all in fp8 (combine stays bf16)")
    p.add_argument("--moe-imbalance", type=float, default=1.0,
                   help="expert load imbalance: busiest rank's tokens / the mean (>= 1)")
    p.add_argument("--mttf-hours", type=_positive, default=0.0,
                   help="mean time to failure of one GPU with its share of host and network, hours; the "
                        "job's is this / gpus (default: Llama 3 405B's 466 interruptions in 54 days on 16,384)")
    p.add_argument("--checkpoint-save-s", type=_positive, default=0.0,
                   help="seconds to save a checkpoint (default: the rank's shard at 2 GB/s)")
    p.add_argument("--checkpoint-load-s", type=_positive, default=0.0,
                   help="seconds to load it after a restart (default: the rank's shard at 2 GB/s)")
    p.add_argument("--restart-s", type=_non_negative, default=-1.0,
                   help="seconds from an interruption to the relaunched job (default 600)")
    p.add_argument("--measure", action="store_true",
                   help="measure matmul peak and all-reduce alpha/beta on this machine")
    p.add_argument("--mode", default="", choices=("", "compile", "kernels", "eager"),
                   help="how the memory-bound ops run, for every searched layout and a --layout without "
                        "mode=: compile (fused, the default), kernels (ndtrain's Triton norm / SwiGLU), eager")
    from ndtrain.cli.plan_rehearse import add_rehearse_args

    add_rehearse_args(p)


def _fail(msg: str) -> int:
    print(f"ndtrain plan: {msg}", file=sys.stderr)
    return 2


def _accelerator(args: argparse.Namespace, acc=None):
    """``--hardware`` (or the measured ``acc``) with ``--hardware-override`` and ``--efficiency``
    applied; raises ValueError for an unknown name, a bad override or an efficiency outside (0, 1]."""
    acc = acc or get_accelerator(args.hardware)
    if args.hardware_override:
        acc = apply_overrides(acc, args.hardware_override)
    if args.efficiency:
        if not 0 < args.efficiency <= 1:
            raise ValueError(f"--efficiency ({args.efficiency}) must be in (0, 1]")
        acc = replace(acc, compute_efficiency=args.efficiency)
    return acc


def _number(text: str, bound: str) -> float:
    """``text`` as a finite float; ArgumentTypeError naming it and ``bound`` (e.g. "> 0") otherwise."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text} is not a number") from None
    if math.isnan(v):
        raise argparse.ArgumentTypeError(f"{text} must be a number {bound}")
    if math.isinf(v):
        raise argparse.ArgumentTypeError(f"{text} must be finite")
    return v


def _positive(text: str) -> float:
    """argparse type: a finite float > 0 (the goodput flags; leave a flag out for its default)."""
    v = _number(text, "> 0")
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be a number > 0 (leave the flag out for its default)")
    return v


def _integer(low: int):
    """argparse type: an integer >= ``low`` (1: leave the flag out for its default)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text} is not an integer") from None
        if v < low:
            hint = " (leave the flag out for its default)" if low >= 1 else ""
            raise argparse.ArgumentTypeError(f"{text} must be >= {low}{hint}")
        return v
    return parse


_count, _whole = _integer(1), _integer(0)


def _non_negative(text: str) -> float:
    """argparse type: a finite float >= 0."""
    v = _number(text, ">= 0")
    if v < 0:
        raise argparse.ArgumentTypeError(f"{text} must be a number >= 0")
    return v


def run_plan(args: argparse.Namespace) -> int:
    """Run ``ndtrain plan``; returns the exit code (2 on bad input, 1 if nothing fits)."""
    from ndtrain.planner.goodput import NeverFinishes
    from ndtrain.planner.model_spec import load_model_spec
    from ndtrain.planner.search import evaluate, recommend, search

    acc = _measure(args) if args.measure else None
    if args.measure and not args.model:
        return 0
    if not args.model:
        return _fail("--model is required")
    try:
        acc = _accelerator(args, acc)
        spec, preset_seq = load_model_spec(args.model)
    except ValueError as e:
        return _fail(str(e))
    gpn = args.gpus_per_node or acc.gpus_per_node
    if args.gpus is None and args.nodes is None:
        return _fail("give --gpus N (or --nodes K)")
    if args.gpus is not None and args.nodes is not None and args.gpus != args.nodes * gpn:
        return _fail(f"--gpus {args.gpus} contradicts --nodes {args.nodes} x {gpn} GPUs per node; give one")
    gpus = args.gpus or args.nodes * gpn
    seq = args.seq_len or preset_seq
    batch = int(args.global_batch_tokens) or _preset_batch_tokens(args.model, seq)
    dtype = "float32" if acc.name == "cpu" and args.dtype == "bfloat16" and args.measure else args.dtype
    try:
        cluster = Cluster(acc, gpus, gpn, args.intra_node_gbps * 1e9, args.inter_node_gbps * 1e9,
                          args.pod_gpus, args.inter_pod_gbps * 1e9, args.price_per_gpu_hour, dtype)
        cluster.accelerator.peak(dtype)  # an unknown dtype fails here, not mid-plan
        w = Workload(seq_len=seq, global_batch_tokens=batch, train_tokens=args.train_tokens,
                     precision=args.precision, moe_max_nodes=args.moe_max_nodes,
                     moe_fp8_dispatch=args.moe_fp8_dispatch, moe_imbalance=args.moe_imbalance,
                     mttf_hours=args.mttf_hours, checkpoint_save_s=args.checkpoint_save_s,
                     checkpoint_load_s=args.checkpoint_load_s, restart_s=args.restart_s,
                     memory_model=args.memory_model or ("trainer" if args.rehearse else "fused"))
    except (ValueError, KeyError) as e:
        return _fail(str(e))
    try:  # an MTTF far below a checkpoint interval: one line, not an overflow
        if args.layout:
            try:
                layout = parse_layout(args.layout)
            except ValueError as e:
                return _fail(str(e))
            if args.mode and "mode=" in args.layout.replace(" ", "") and layout.mode != args.mode:
                return _fail(f"--mode {args.mode} contradicts the layout's mode={layout.mode}")
            if args.mode:
                layout = replace(layout, mode=args.mode)
            for note in layout_assumptions(args.layout, layout):
                print(f"assumed: {note}", file=sys.stderr if args.json else sys.stdout)
            plans = [evaluate(spec, cluster, w, layout)]
            if plans[0].errors and plans[0].memory is None:  # breaks a rule: not a plan at all
                return _fail("invalid layout: " + "; ".join(plans[0].errors))
            rec = plans[0] if plans[0].fits else None
            for rule in plans[0].unsupported:
                print(f"not accepted by ndtrain train: {rule}", file=sys.stderr if args.json else sys.stdout)
            everything = plans
        else:
            everything = search(spec, cluster, w, top=0, include_unsupported=args.include_unsupported,
                                mode=args.mode or "compile")
            rec = recommend(everything)
            plans = everything[:args.top] if args.top else everything
            if rec is not None and rec not in plans:
                plans = [rec] + plans
    except NeverFinishes as e:
        return _fail(str(e))
    reasons = _reasons(args, rec, everything, spec, cluster, w)
    if cluster.precision_note():
        print(cluster.precision_note(), file=sys.stderr if args.json else sys.stdout)
    _print_quietly(_print_plans, args, plans, rec, reasons, spec, f"{gpus} x {acc.name}", seq, batch)
    if args.rehearse > 0:
        return _rehearse(args, spec, cluster, w, everything)
    if args.report:
        from ndtrain.planner.report import write_report

        md = write_report(args.report, plans, rec, reasons, spec, cluster, w)
        print(f"report: {md}", file=sys.stderr if args.json else sys.stdout)
    return 0 if rec is not None else 1


def _measure(args: argparse.Namespace):
    """``--measure``: time this machine's matmul peak and all-reduce, print them; the measured
    accelerator with ``--hardware cpu``, else None."""
    from ndtrain.calibration.measure import (
        format_measurements,
        measure_collectives,
        measure_matmul_flops,
        measured_accelerator,
    )

    mm = measure_matmul_flops(dtype="float32" if args.hardware == "cpu" else args.dtype)
    comm = measure_collectives()
    print(format_measurements(mm, comm), file=sys.stderr if args.json else sys.stdout)
    return measured_accelerator(mm, comm) if args.hardware == "cpu" else None


def _rehearse(args, spec, cluster, w, everything) -> int:
    """``--rehearse K``: the top K rehearsed and ranked (``cli.plan_rehearse``); 0 if one fits."""
    from ndtrain.cli.plan_rehearse import print_rehearsed, rehearse_top

    say = lambda text: print(text, file=sys.stderr, flush=True)
    recs = rehearse_top(args.model, spec, cluster, w, everything, args.rehearse, args.rehearse_cache or None, say)
    print_rehearsed(recs, args.json)
    return 0 if any(r["fits"] for r in recs) else 1


def _reasons(args, rec, everything, spec, cluster, w) -> list[str]:
    """The lines under the table: why the recommendation (or why none, and what would work:
    the nearest GPU counts and batch sizes); prints the NVLink-domain warnings."""
    from ndtrain.planner.search import explain, goodput_line
    from ndtrain.planner.suggest import alignment_warnings, suggestions

    err = sys.stderr if args.json else sys.stdout
    reasons = explain(rec, everything, spec, cluster, w) if rec is not None and not args.layout else []
    if not everything:  # say which constraint failed instead of "nothing fits in memory"
        from ndtrain.planner.diagnose import diagnose

        reasons = diagnose(spec, cluster, w)
    if rec is None and not args.layout:  # nothing fits or divides: what would
        reasons = reasons + suggestions(spec, cluster, w)
    if args.json and rec is None and not args.layout:
        print("\n".join(reasons), file=sys.stderr)
    if rec is not None and args.layout:
        reasons = explain(rec, [], spec, cluster, w)[:3] + [goodput_line(rec)]
    for warn in alignment_warnings(cluster, rec.layout if rec is not None else None):
        print(f"warning: {warn}", file=err)
    return reasons


def _print_quietly(fn, *args) -> None:
    """``fn(*args)``; when the reader of stdout has left (``ndtrain plan --json | head -1``), stop
    printing without a BrokenPipeError traceback (stdout then points at /dev/null, so the
    interpreter's final flush does not fail either)."""
    try:
        fn(*args)
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _print_plans(args, plans, rec, reasons, spec, where: str, seq: int, batch: int) -> None:
    """Print the ranked plans: one JSON object per line (``--json``) or the table, the
    recommendation and its reasons, or why nothing fits."""
    if args.json:
        for p in plans:
            print(json.dumps(p.to_dict()))
        return
    from ndtrain.planner.report import format_table

    n = spec.params_total
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
    print(f"{spec.name}: {size} params on {where}, T = {seq}, "
          f"{batch:,} tokens/step")
    print(format_table(plans, rec))
    if rec is not None:
        print(f"\nrecommended: {rec.layout}")
        for r in reasons:
            print(f"  - {r}")
    elif plans and plans[0].fits and plans[0].unsupported:
        print("\nno layout ndtrain train accepts fits; the rows marked '!' are modelled only")
    elif plans and plans[0].memory and not plans[0].errors:
        p = plans[0]
        print(f"\ndoes not fit: {p.memory.total / 2**30:.1f} GiB > {p.memory.capacity / 2**30:.1f} GiB: "
              + ", ".join(f"{k} {v / 2**30:.1f}" for k, v in p.memory.breakdown.items()))
    elif plans and plans[0].errors:
        print("\ninvalid layout: " + "; ".join(plans[0].errors))
    else:
        print("\nno layout proposed:\n" + "\n".join(reasons))


def _preset_batch_tokens(model: str, seq: int) -> int:
    """The preset's global batch in tokens (kept when --seq-len changes), else 4M tokens; rounded
    down to whole sequences of ``seq``."""
    try:
        from ndtrain.config import load_config

        cfg = load_config(model)
        tokens = cfg.training.global_batch_size * cfg.data.seq_len
    except (ValueError, OSError):  # not a preset (e.g. a HF config.json)
        tokens = 4 * 2**20
    return max(1, tokens // seq) * seq


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ndtrain plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_args(parser)
    return run_plan(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
