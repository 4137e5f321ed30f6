"""DiLoCo (H = 10) against synchronous data parallel: loss vs bytes communicated.

    python bench/diloco.py [--steps 200] [--h 10]

Both runs train the ``default`` preset scaled down to a few minutes on a 2-core CPU (2 layers,
dim 128, seq 64, byte tokenizer, float32; the stdlib corpus of the preset), on 2 gloo processes
laid out as ``dp_replicate 2``, the same data order and seeds, through ``ndtrain train``'s own
``launch``:

* ``sync``: synchronous data parallel (DDP all-reduce of the gradients every step);
* ``diloco``: ``training.local_sgd_steps=H``, outer Nesterov SGD lr 0.7, momentum 0.9 (the
  paper's values, Douillard et al. 2023), inner AdamW as in ``sync``.

Bytes are what ``ndtrain.parallel.comm`` counts on every axis (the ``comm_bytes`` of each metrics
row, summed): gradients / parameter deltas plus the small loss and agreement all-reduces. The
validation loss is measured every 2H steps (outer-step boundaries, where the replicas agree).
Writes ``bench/results/diloco.json`` and ``docs/images/diloco_loss_vs_bytes.png``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ndtrain.cli.launch import launch
from ndtrain.config import load_config
from ndtrain.train.metrics import read_metrics


def _cfg(steps: int, h: int, every: int, out: Path):
    over = {"model.n_layers": 2, "model.dim": 128, "model.n_heads": 4, "model.n_kv_heads": 2,
            "model.ffn_hidden": 384, "model.vocab_size": 512, "data.tokenizer": "bytes",
            "data.seq_len": 64, "data.max_corpus_bytes": 2_000_000, "data.cache_dir": str(out / "cache"),
            "training.steps": steps, "training.dtype": "float32", "training.global_batch_size": 16,
            "training.micro_batch_size": 8, "training.warmup_steps": 10, "training.eval_every": 2 * every,
            "training.eval_batches": 4, "training.sample_tokens": 0, "checkpoint.every": 0,
            "logging.log_every": every, "logging.plot": False,
            "parallel.dp_replicate": 2, "parallel.dp_shard": 1}
    if h:
        over.update({"training.local_sgd_steps": h, "training.outer_lr": 0.7, "training.outer_momentum": 0.9})
    return load_config("default", over, world_size=2)


def _curve(run_dir: Path) -> dict:
    rows, total, out = read_metrics(run_dir), 0.0, {"step": [], "bytes": [], "loss": [], "val": []}
    for r in rows:
        total += sum((r.get("comm_bytes") or {}).values())
        if "loss" in r:
            out["step"].append(r["step"])
            out["bytes"].append(total)
            out["loss"].append(r["loss"])
        if "val_loss" in r and r["step"] > 0:
            out["val"].append([r["step"], total, r["val_loss"]])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--h", type=int, default=10)
    ap.add_argument("--out", default="/tmp/ndtrain_bench_diloco")
    a = ap.parse_args()
    out = Path(a.out)
    res = {"steps": a.steps, "h": a.h, "runs": {}}
    for name, h in (("sync", 0), ("diloco", a.h)):
        run_dir = out / name
        if run_dir.exists():
            import shutil

            shutil.rmtree(run_dir)
        t0 = time.perf_counter()
        launch(_cfg(a.steps, h, a.h, out), run_dir, nproc=2)
        curve = _curve(run_dir)
        curve["wall_s"] = time.perf_counter() - t0
        res["runs"][name] = curve
    s, d = res["runs"]["sync"], res["runs"]["diloco"]
    res["bytes_ratio_diloco_vs_sync"] = d["bytes"][-1] / s["bytes"][-1]
    res["final_val_loss"] = {"sync": s["val"][-1][2], "diloco": d["val"][-1][2]}
    res["wall_ratio_diloco_vs_sync"] = d["wall_s"] / s["wall_s"]
    (ROOT / "bench" / "results").mkdir(parents=True, exist_ok=True)
    (ROOT / "bench" / "results" / "diloco.json").write_text(json.dumps(res, indent=1))
    _plot(res, ROOT / "docs" / "images" / "diloco_loss_vs_bytes.png")
    print(json.dumps({k: v for k, v in res.items() if k != "runs"}, indent=1))


def _plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for name, c in res["runs"].items():
        label = "synchronous DP" if name == "sync" else f"DiLoCo H={res['h']}"
        ax[0].plot([b / 1e6 for b in c["bytes"]], c["loss"], label=f"{label} (train)")
        ax[0].plot([v[1] / 1e6 for v in c["val"]], [v[2] for v in c["val"]], "o--", label=f"{label} (val)")
        ax[1].plot(c["step"], c["loss"], label=label)
    ax[0].set_xlabel("MB sent per rank (all axes)")
    ax[0].set_xscale("log")
    ax[0].set_ylabel("loss")
    ax[1].set_xlabel("step")
    ax[1].set_ylabel("train loss")
    for x in ax:
        x.legend()
        x.grid(alpha=0.3)
    fig.suptitle(f"DiLoCo vs synchronous DP, 2 replicas, {res['steps']} steps")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
