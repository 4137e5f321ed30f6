"""Tokens/s and MFU of a config, measured by running ``ndtrain train`` itself.

    python bench/train_throughput.py [--config default] [--nproc 2] [--steps 40]

Runs the trainer (no checkpoints, no eval until the end), reads ``metrics.jsonl`` and reports the
mean tokens/s and MFU over the logged windows after the first (which includes warm-up). Writes
``bench/results/train_throughput_<config>_<nproc>p.json``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="default")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "ndtrain.cli.commands", "train", "--config", args.config, "--nproc",
               str(args.nproc), f"--run-dir={tmp}/run", f"--training.steps={args.steps}",
               "--logging.log_every=10", "--checkpoint.every=0", "--training.eval_every=0",
               "--logging.plot=false", "--training.sample_tokens=0"]
        subprocess.run(cmd, check=True, cwd=ROOT)
        rows = [json.loads(l) for l in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "tokens_per_s" in r][1:]
    res = {"config": args.config, "nproc": args.nproc, "steps": args.steps,
           "tokens_per_s": statistics.mean(r["tokens_per_s"] for r in rows),
           "mfu": statistics.mean(r["mfu"] for r in rows if r["mfu"] is not None),
           "step_time_s": statistics.mean(r["step_time_s"] for r in rows),
           "peak_mem_bytes": max(r["peak_mem_bytes"] for r in rows)}
    out = ROOT / "bench" / "results" / f"train_throughput_{args.config}_{args.nproc}p.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
