"""Per-rank memory of DDP / ZeRO-1 / ZeRO-2 / ZeRO-3 on a model whose training state dominates.

    python bench/dp_memory.py [--nproc 4] [--steps 3] [--plot docs/dp_memory.png] [--replot]

Each layout trains the same model (bf16 compute, fp32 masters and AdamW; dim 512, 4 blocks, vocab
8192, T 64, one sequence per rank) in fresh gloo processes and reports, for rank 0:

* ``state_bytes_per_param``: peak params + grads + optimizer state (``ndtrain.mem_account``),
  against the ZeRO formulas (DDP 16, ZeRO-1 4 + 12/N, ZeRO-2 2 + 16/N with fp32 gradient shards,
  ZeRO-3 16/N);
* ``buffers_bytes``: transient gathered parameters / communication buffers;
* ``activations_peak_bytes``: ``ActivationMeter`` over one microbatch;
* ``max_rss_bytes``: the process's peak resident set (includes ~0.3-0.5 GB of PyTorch itself);
* ratios of the state bytes against DDP in the same command.

Writes ``bench/results/dp_memory.json`` (and a bar chart with ``--plot``).
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ndtrain.config import Config, ModelConfig, ParallelConfig, TrainingConfig
from ndtrain.mesh import ParallelDims
from ndtrain.spawn import spawn
from ndtrain.train.loop import Trainer


def _cfg(stage: int, nproc: int) -> Config:
    return Config(model=ModelConfig(vocab_size=8192, dim=512, n_layers=4, n_heads=8, ffn_hidden=1536,
                                    max_seq_len=64, rope_theta=1e4),
                  training=TrainingConfig(dtype="bfloat16", global_batch_size=nproc, lr=1e-3),
                  parallel=ParallelConfig(zero_stage=stage, bucket_size_bytes=4 * 2**20))


def _worker(rank: int, world: int, stage: int, steps: int) -> dict | None:
    cfg = _cfg(stage, world)
    tr = Trainer(cfg, ParallelDims.from_config(cfg.parallel, world).build_mesh(), torch.device("cpu"))
    n = sum(p.numel() for p in tr.model.parameters())
    for s in range(steps):
        g = torch.Generator().manual_seed(s)
        x = torch.randint(0, cfg.model.vocab_size, (world, 64), generator=g)
        tr.measure_memory = s == steps - 1
        res = tr.step(x[rank:rank + 1], torch.roll(x, -1, 1)[rank:rank + 1])
    if rank == 0:
        return {
            "stage": stage, "params": n, "state_bytes": res["mem_state_peak_bytes"],
            "state_bytes_per_param": res["mem_state_peak_bytes"] / n,
            "params_bytes": res["mem_params_bytes"], "grads_bytes": res["mem_grads_bytes"],
            "optim_bytes": res["mem_optim_bytes"], "buffers_bytes": res["mem_buffers_bytes"],
            "activations_peak_bytes": res["mem_activations_peak_bytes"],
            "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "loss": res["loss"]}
    return None


def formula(stage: int, n: int) -> float:
    """Bytes per parameter of params + grads + optimizer state (bf16 compute, fp32 Adam, K = 12)."""
    return {0: 16.0, 1: 4 + 12 / n, 2: 2 + 16 / n, 3: 16 / n}[stage]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--plot", default="")
    ap.add_argument("--replot", action="store_true", help="only redraw --plot from the saved JSON")
    args = ap.parse_args()
    dest = ROOT / "bench" / "results" / "dp_memory.json"
    if args.replot:
        saved = json.loads(dest.read_text())
        _plot(saved["rows"], saved["nproc"], Path(args.plot))
        return
    rows = []
    for stage in (0, 1, 2, 3):
        r = spawn(_worker, args.nproc, (stage, args.steps), backend="gloo", threads=1)[0]
        r["formula_bytes_per_param"] = formula(stage, args.nproc)
        r["state_vs_ddp"] = r["state_bytes"] / rows[0]["state_bytes"] if rows else 1.0
        rows.append(r)
        name = "DDP" if stage == 0 else f"ZeRO-{stage}"
        print(f"{name:7s} state {r['state_bytes'] / 2**20:8.1f} MiB = {r['state_bytes_per_param']:5.2f} B/param "
              f"(formula {r['formula_bytes_per_param']:5.2f}, {r['state_vs_ddp']:.2f}x DDP) | buffers "
              f"{r['buffers_bytes'] / 2**20:6.1f} MiB | activations {r['activations_peak_bytes'] / 2**20:6.1f} MiB "
              f"| max RSS {r['max_rss_bytes'] / 2**20:7.1f} MiB", flush=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps({"nproc": args.nproc, "rows": rows, "torch": torch.__version__}, indent=1))
    print(f"wrote {dest}")
    if args.plot:
        _plot(rows, args.nproc, Path(args.plot))


def _plot(rows: list[dict], n: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["DDP" if r["stage"] == 0 else f"ZeRO-{r['stage']}" for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    bottom = [0.0] * len(rows)
    for key, label in (("params_bytes", "params"), ("grads_bytes", "grads"), ("optim_bytes", "optimizer")):
        vals = [r[key] / r["params"] for r in rows]
        ax.bar(names, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.scatter(names, [r["formula_bytes_per_param"] for r in rows], color="k", marker="_", s=600,
               label="formula (peak sum)", zorder=3)
    ax.set_ylabel("bytes per parameter (per rank)")
    ax.set_title(f"model state per rank (N = {n}, bf16 + fp32 AdamW)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
