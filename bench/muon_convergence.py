"""Validation loss of Muon against AdamW on the same tokens, each with its best LR of a short sweep.

    python bench/muon_convergence.py                      # debug preset, 150 steps, 3 LRs each
    python bench/muon_convergence.py --preset default --steps 300

Each run is ``ndtrain train --config PRESET`` in its own run directory (one process, the preset's
batch, schedule and data; validation every ``--eval-every`` steps on the preset's ``eval_batches``),
with ``training.optimizer`` adamw or muon (``muon_scale: moonlight``, so one LR grid serves both)
and ``training.lr`` from ``--lrs``. The best LR per optimizer is the one with the lowest final
validation loss. Reported: both curves, and the first evaluated step at which the best Muon run's
validation loss is at or below the best AdamW run's final one (``muon_steps_to_adamw_final``).

Writes ``bench/results/muon_convergence_<preset>.json`` and ``docs/images/muon_convergence_<preset>.png``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ndtrain.tools.bench_utils import write_result


def run(preset: str, optimizer: str, lr: float, steps: int, eval_every: int, root: Path) -> list[tuple[int, float]]:
    """(step, validation loss) pairs of one run."""
    run_dir = root / f"{optimizer}_{lr:g}"
    cmd = [sys.executable, "-m", "ndtrain.cli", "train", "--config", preset, "--run-dir", str(run_dir), "--nproc", "1",
           f"--training.steps={steps}", f"--training.optimizer={optimizer}", f"--training.lr={lr}",
           f"--training.eval_every={eval_every}", "--checkpoint.every=0", "--training.sample_every=0",
           f"--logging.log_every={eval_every}", "--logging.plot=false"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return sorted({r["step"]: r["val_loss"] for r in rows if "val_loss" in r}.items())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="debug")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--lrs", default="1e-3,3e-3,1e-2")
    args = ap.parse_args()
    lrs = [float(x) for x in args.lrs.split(",")]
    curves: dict[str, dict[float, list]] = {"adamw": {}, "muon": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for opt, by_lr in curves.items():
            for lr in lrs:
                by_lr[lr] = run(args.preset, opt, lr, args.steps, args.eval_every, Path(tmp))
                print(f"{opt} lr {lr:g}: final val {by_lr[lr][-1][1]:.4f}", flush=True)
    best = {o: min(c, key=lambda lr: c[lr][-1][1]) for o, c in curves.items()}
    target = curves["adamw"][best["adamw"]][-1][1]
    reach = next((s for s, v in curves["muon"][best["muon"]] if v <= target), None)
    result = {"preset": args.preset, "steps": args.steps, "lrs": lrs, "best_lr": best,
              "curves": {o: {str(lr): c for lr, c in cs.items()} for o, cs in curves.items()},
              "adamw_final_val": target, "muon_final_val": curves["muon"][best["muon"]][-1][1],
              "muon_steps_to_adamw_final": reach}
    out = write_result(ROOT / "bench" / "results" / f"muon_convergence_{args.preset}.json", result, "cpu")
    print(f"best lr {best}; AdamW final val {target:.4f} at step {args.steps}; Muon reaches it at step {reach}")
    print(f"wrote {out}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for o in curves:
        xs, ys = zip(*curves[o][best[o]])
        ax.plot(xs, ys, marker="o", label=f"{o} (lr {best[o]:g})")
    ax.axhline(target, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("step (same tokens per step)")
    ax.set_ylabel("validation loss")
    ax.set_title(f"{args.preset} preset: Muon vs AdamW, best LR of {len(lrs)} each")
    ax.legend()
    fig.tight_layout()
    png = ROOT / "docs" / "images" / f"muon_convergence_{args.preset}.png"
    fig.savefig(png, dpi=100)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
