"""How long a full-size rehearsal takes on this machine, and how much host memory each role needs.

    python bench/rehearsal_speed.py                                   # llama3_8b, tp8 on 8 GPUs
    python bench/rehearsal_speed.py --config llama3_70b --gpus 64 --set parallel.tp=8 --set parallel.pp=8

Runs ``ndtrain.rehearsal.run.rehearse`` (each role in its own worker process, one after the other)
and records per role: wall seconds (build + warm-up step + measured step), peak host resident
memory of the worker (bytes), the measured step's seconds, and the rehearsed peak tensor memory
(bytes, total and by category), and the estimated step time on ``--hardware`` (per role and of the
job over the roles rehearsed: ``ndtrain.rehearsal.timing``). Writes ``bench/results/rehearsal_speed.json`` (one entry per
configuration, merged into the file)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="llama3_8b")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--hardware", default="H100")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override (repeatable); default for llama3_8b: parallel.tp=8, 8 sequences")
    ap.add_argument("--roles", default="", help="comma-separated role indices to rehearse (default: all); "
                    "-1 is the last")
    ap.add_argument("--slow", action="store_true", help="the fake world's slow twins (rehearsal.replay."
                    "fast_paths off): the same figures, the wall time before the fast paths")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "rehearsal_speed.json"))
    args = ap.parse_args()
    from ndtrain.config import load_config
    from ndtrain.rehearsal.run import rehearse
    from ndtrain.tools.bench_utils import machine_info

    sets = args.set or ["parallel.tp=8", "training.global_batch_size=8", "training.micro_batch_size=1"]
    over = dict(s.split("=", 1) for s in sets)
    cfg = load_config(args.config, over, world_size=args.gpus)
    from ndtrain.rehearsal.roles import rank_roles

    n_roles = len(rank_roles(cfg, args.gpus))
    only = [int(i) % n_roles for i in args.roles.split(",")] if args.roles else None
    t0 = time.perf_counter()
    res = rehearse(args.config, over, cfg, args.gpus, args.hardware,
                   progress=lambda text: print(text, file=sys.stderr, flush=True), only=only, fast=not args.slow)
    entry = {"config": args.config, "overrides": over, "gpus": args.gpus, "layout": res["layout"],
             "fast_paths": not args.slow, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
             "hardware": args.hardware, "total_wall_s": time.perf_counter() - t0, "roles": [
                 {"role": r["role"]["name"], "rank": r["role"]["rank"], "ranks_alike": r["role"]["ranks_alike"],
                  "wall_s": r["wall_s"], "step_s": r["step_s"], "host_peak_bytes": r["host_peak_bytes"],
                  "peak_tensor_bytes": r["memory_peak"]["total"], "memory_peak": r["memory_peak"],
                  "fits": r["fits"], "planner_total_bytes": r["planner"].get("total_bytes"),
                  "microbatches": r.get("microbatches"), "saved_weight_copy_bytes": r.get("saved_weight_copy_bytes"),
                  "pack_replay": r.get("pack_replay"),
                  "estimated_time": {k: v for k, v in r["time"].items() if k != "compute_by_kind_s"}}
                 for r in res["roles"]],
             "estimated_job_time": res.get("time")}
    out = Path(args.out)
    old = json.loads(out.read_text()) if out.exists() else {}
    key = lambda e: (e["config"], e["gpus"], e["overrides"], [r["role"] for r in e["roles"]], e.get("fast_paths", False))
    runs = [e for e in old.get("runs", []) if key(e) != key(entry)] + [entry]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine_info(), "runs": runs}, indent=1) + "\n")
    print(json.dumps(entry, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
