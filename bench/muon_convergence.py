"""Validation loss of Muon against AdamW on the same tokens, each with its best LR of a short sweep.

    python bench/muon_convergence.py                      # debug preset, 150 steps, 3 LRs each
    python bench/muon_convergence.py --preset default --sweep-steps 150 --steps 300 \
        --lrs 1e-3,2e-3,4e-3 --muon-lrs 2e-3,4e-3,8e-3 --eval-every 25 --jobs 2
    python bench/muon_convergence.py --preset default --steps 150 --report-only ...  # what finished

Each run is ``ndtrain train --config PRESET`` in its own run directory (one process, one torch
thread, ``nice -n 10``, at most ``--jobs`` at a time; the preset's batch, schedule and data;
validation every ``--eval-every`` steps on the preset's ``eval_batches``), with ``training.optimizer``
adamw or muon (``muon_scale: moonlight``, whose update RMS matches AdamW's) and ``training.lr`` from
``--lrs`` (AdamW) or ``--muon-lrs`` (Muon; default the same grid). The sweep runs
``--sweep-steps`` steps (the cosine schedule spans them); the LR with the lowest final validation
loss per optimizer is then run to ``--steps`` (skipped when equal: the sweep run is the final one).
Reported: both final curves, and the first evaluated step at which the best Muon run's validation
loss is at or below the best AdamW run's final one (``muon_steps_to_adamw_final``).

Run directories persist under ``--work`` (a finished run is read back, not rerun), so an
interrupted comparison resumes. Writes ``bench/results/muon_convergence_<preset>.json`` and
``docs/images/muon_convergence_<preset>.png``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ndtrain.tools.bench_utils import write_result


def _cmd(preset: str, optimizer: str, lr: float, steps: int, eval_every: int, run_dir: Path) -> list[str]:
    return ["nice", "-n", "10", sys.executable, "-m", "ndtrain.cli", "train", "--config", preset,
            "--run-dir", str(run_dir), "--nproc", "1", f"--training.steps={steps}",
            f"--training.optimizer={optimizer}", f"--training.lr={lr}", f"--training.eval_every={eval_every}",
            "--checkpoint.every=0", "--training.sample_every=0", f"--logging.log_every={eval_every}",
            "--logging.plot=false"]


def _curve(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return sorted({r["step"]: r["val_loss"] for r in rows if "val_loss" in r}.items())


def run_all(jobs: list[tuple], args, work: Path) -> dict[tuple, list]:
    """``{(optimizer, lr, steps): (step, val loss) pairs}``, at most ``args.jobs`` runs at once."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    out, todo, live = {}, list(jobs), []
    while todo or live:
        while todo and len(live) < args.jobs:
            opt, lr, steps = key = todo.pop(0)
            run_dir = work / f"{args.preset}_{opt}_{lr:g}_{steps}"
            if (run_dir / "DONE").exists():
                out[key] = _curve(run_dir)
                continue
            log = open(work / f"{run_dir.name}.log", "w")  # noqa: SIM115 (open while the run lives)
            cmd = _cmd(args.preset, opt, lr, steps, args.eval_every, run_dir)
            live.append((key, run_dir, subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)))
        time.sleep(2)
        for item in [x for x in live if x[2].poll() is not None]:
            live.remove(item)
            key, run_dir, proc = item
            if proc.returncode:
                raise RuntimeError(f"run {run_dir.name} failed (rc {proc.returncode}); see {run_dir}.log")
            (run_dir / "DONE").write_text("")
            out[key] = _curve(run_dir)
            print(f"{key}: final val {out[key][-1][1]:.4f}", flush=True)
    return out


def plot(curves: dict, best: dict, target: float, preset: str, n_lrs: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for o, c in curves.items():
        xs, ys = zip(*c)
        ax.plot(xs, ys, marker="o", label=f"{o} (lr {best[o]:g})")
    ax.axhline(target, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("step (same tokens per step)")
    ax.set_ylabel("validation loss")
    ax.set_title(f"{preset} preset: Muon vs AdamW, best LR of {n_lrs}")
    ax.legend()
    fig.tight_layout()
    png = ROOT / "docs" / "images" / f"muon_convergence_{preset}.png"
    fig.savefig(png, dpi=100)
    return png


def report_only(args) -> None:
    """The comparison from the finished runs alone (an LR sweep cut short: the grids shrink to what
    finished; the JSON lists every LR asked for and which ones ran)."""
    work = Path(args.work)
    asked = {"adamw": [float(x) for x in args.lrs.split(",")],
             "muon": [float(x) for x in (args.muon_lrs or args.lrs).split(",")]}
    done = {o: [lr for lr in lrs if (work / f"{args.preset}_{o}_{lr:g}_{args.steps}" / "DONE").exists()]
            for o, lrs in asked.items()}
    runs = {o: {lr: _curve(work / f"{args.preset}_{o}_{lr:g}_{args.steps}") for lr in lrs} for o, lrs in done.items()}
    best = {o: min(r, key=lambda lr: r[lr][-1][1]) for o, r in runs.items()}
    curves = {o: runs[o][best[o]] for o in runs}
    target = curves["adamw"][-1][1]
    reach = next((s for s, v in curves["muon"] if v <= target), None)
    result = {"preset": args.preset, "steps": args.steps, "lrs_asked": asked, "lrs_run": done, "best_lr": best,
              "eval_every": args.eval_every,
              "final_val": {o: {str(lr): c[-1][1] for lr, c in r.items()} for o, r in runs.items()},
              "all_curves": {o: {str(lr): c for lr, c in r.items()} for o, r in runs.items()},
              "curves": curves, "adamw_final_val": target, "muon_final_val": curves["muon"][-1][1],
              "muon_steps_to_adamw_final": reach}
    out = write_result(ROOT / "bench" / "results" / f"muon_convergence_{args.preset}.json", result, "cpu")
    print(f"ran {done}; best lr {best}; AdamW final val {target:.4f} at step {args.steps}; Muon reaches it at step {reach}")
    png = plot(curves, best, target, args.preset, f"{len(done['adamw'])} / {len(done['muon'])} (AdamW / Muon)")
    print(f"wrote {out}; wrote {png}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="debug")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--sweep-steps", type=int, default=0, help="0 = --steps")
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--lrs", default="1e-3,3e-3,1e-2")
    ap.add_argument("--muon-lrs", default="", help="empty = --lrs")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--work", default="/tmp/muon_convergence")
    ap.add_argument("--report-only", action="store_true",
                    help="launch nothing: report the finished runs of the grids at --steps (each grid cut to them)")
    args = ap.parse_args()
    if args.report_only:
        return report_only(args)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    grid = {"adamw": [float(x) for x in args.lrs.split(",")],
            "muon": [float(x) for x in (args.muon_lrs or args.lrs).split(",")]}
    sweep_steps = args.sweep_steps or args.steps
    order = [(o, grid[o][i], sweep_steps) for i in range(max(map(len, grid.values()))) for o in grid if i < len(grid[o])]
    sweep = run_all(order, args, work)  # adamw and muon interleaved, so a cut-short sweep has both
    best = {o: min(grid[o], key=lambda lr: sweep[(o, lr, sweep_steps)][-1][1]) for o in grid}
    final = run_all([(o, best[o], args.steps) for o in grid], args, work)
    curves = {o: final[(o, best[o], args.steps)] for o in grid}
    target = curves["adamw"][-1][1]
    reach = next((s for s, v in curves["muon"] if v <= target), None)
    result = {"preset": args.preset, "steps": args.steps, "sweep_steps": sweep_steps, "lrs": grid,
              "best_lr": best, "eval_every": args.eval_every,
              "sweep_final_val": {o: {str(lr): sweep[(o, lr, sweep_steps)][-1][1] for lr in grid[o]} for o in grid},
              "sweep_curves": {o: {str(lr): sweep[(o, lr, sweep_steps)] for lr in grid[o]} for o in grid},
              "curves": curves, "adamw_final_val": target, "muon_final_val": curves["muon"][-1][1],
              "muon_steps_to_adamw_final": reach}
    out = write_result(ROOT / "bench" / "results" / f"muon_convergence_{args.preset}.json", result, "cpu")
    print(f"best lr {best}; AdamW final val {target:.4f} at step {args.steps}; Muon reaches it at step {reach}")
    png = plot(curves, best, target, args.preset, f"{len(grid['adamw'])} / {len(grid['muon'])} (AdamW / Muon)")
    print(f"wrote {out}; wrote {png}")


if __name__ == "__main__":
    main()
