"""Chaos benchmark: wall-time overhead of surviving ``kill -9`` with ``--max-restarts``.

Runs the same training twice in one command: uninterrupted (``--max-restarts 0``), then with a
seeded driver (``ndtrain.fault.chaos``) that SIGKILLs a random rank ``--kills`` times (``--save-kills``
of them while a checkpoint is being written). Reports the wall time of both and their ratio, the
steps recomputed (``steps_lost`` of the ``restart`` events: steps trained after the checkpoint the
next attempt resumed from), the restarts, whether every logged loss equals the uninterrupted
run's (float64: bitwise), and both runs' goodput accounting (``ndtrain.fault.goodput``: the final
``goodput`` event and the printed line).

Each restart costs one start-up of every rank (interpreter, ``import torch``, model build) plus the
steps since the last checkpoint; on a tiny model the start-up dominates.

Usage: ``python bench/chaos.py [--kills 10] [--steps 60] [--every 3] [--nproc 2] [--async-save]``;
writes ``bench/results/chaos.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ndtrain.events import read_events
from ndtrain.fault.chaos import chaos_run
from ndtrain.train.metrics import read_metrics


def _cmd(run_dir: Path, args: argparse.Namespace, corpus: Path, cache: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ndtrain.cli.commands", "train", "--config", "debug", "--nproc", str(args.nproc),
            f"--run-dir={run_dir}", f"--data.source={corpus}", "--data.tokenizer=bytes",
            f"--data.cache_dir={cache}", f"--training.steps={args.steps}", "--training.dtype=float64",
            "--logging.log_every=1", "--training.eval_every=0", f"--checkpoint.every={args.every}",
            "--training.sample_tokens=4", "--logging.plot=false",
            f"--checkpoint.async_save={'true' if args.async_save else 'false'}", *extra]


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--save-kills", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=3, help="checkpoint every this many steps")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-delay-s", type=float, default=1.0)
    ap.add_argument("--async-save", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "chaos.json"))
    args = ap.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory(prefix="ndtrain-chaos-") as tmp:
        tmp = Path(tmp)
        corpus = tmp / "corpus.txt"
        corpus.write_text("\n".join(p.read_text() for p in sorted((ROOT / "ndtrain").rglob("*.py")))[:60000])
        cache = tmp / "cache"
        t0 = time.monotonic()
        ref = subprocess.run(_cmd(tmp / "ref", args, corpus, cache), check=False, capture_output=True, text=True, env=env, cwd=ROOT)
        ref_s = time.monotonic() - t0
        if ref.returncode != 0:
            raise SystemExit(ref.stdout + ref.stderr)
        res = chaos_run(_cmd(tmp / "chaos", args, corpus, cache, "--max-restarts", str(args.kills * 4 + 5)),
                        tmp / "chaos", args.nproc, args.kills, args.seed, save_kills=args.save_kills,
                        max_delay_s=args.max_delay_s, timeout_s=3600, env=env)
        restarts = read_events(tmp / "chaos", "restart")
        want, got = _losses(tmp / "ref"), _losses(tmp / "chaos")
        same = sorted(got) == sorted(want) and all(got[s] == want[s] for s in want)
        goodput = {name: ([e for e in read_events(tmp / name, "goodput") if e.get("final")] or [None])[-1]
                   for name in ("ref", "chaos")}
        lines = {name: next((x for x in out.splitlines() if x.startswith("goodput ")), None)
                 for name, out in (("ref", ref.stdout), ("chaos", res.output))}
    result = {
        "config": {k: getattr(args, k) for k in ("kills", "save_kills", "steps", "every", "nproc", "seed",
                                                 "max_delay_s", "async_save")},
        "returncode": res.returncode, "uninterrupted_s": round(ref_s, 2), "chaos_s": round(res.wall_s, 2),
        "overhead_ratio": round(res.wall_s / ref_s, 3), "kills": len(res.kills),
        "kills_during_save": sum(k["during_save"] for k in res.kills), "restarts": len(restarts),
        "steps_recomputed": sum(e.get("steps_lost") or 0 for e in restarts),
        "overhead_s_per_restart": round((res.wall_s - ref_s) / max(1, len(restarts)), 2),
        "losses_equal_uninterrupted": same, "goodput": goodput, "goodput_line": lines, "kill_log": res.kills,
        "note": "2-core shared CPU machine: wall times include other jobs' load; the ratio is indicative",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "kill_log"}, indent=1))


if __name__ == "__main__":
    main()
