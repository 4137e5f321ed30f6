"""``training.compile=true`` vs eager on the ``default`` preset, in one process and one command.

    python bench/compile_speed.py [--steps 10] [--warmup 3] [--threads N]

Two ``Trainer``s of the ``default`` preset (12.6M parameters, bf16 autocast over fp32 weights, its
own sequence length and global batch) are built side by side, one with ``training.compile=true``
(``torch.compile`` of each block's forward, ``ndtrain/parallel/compile.py``); warm-up steps
(Inductor compiles during the first ones) are not timed. Then steps alternate A, B / B, A on the
same random batches, so a load change on a shared machine hits both alike; the medians give
tokens/s and ``ratio = compiled tokens/s / eager tokens/s`` (target: >= 1.1).
Also reports the two runs' losses on the last step (compiled and eager should agree to bf16
roundoff). Writes ``bench/results/compile_speed.json`` with the load average before and after
(``ndtrain.tools.bench_utils.write_result``: machine info and date too).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build(compile_: bool):
    from ndtrain.config import load_config
    from ndtrain.mesh import ParallelDims
    from ndtrain.train.trainer import Trainer

    cfg = load_config("default", {"training.compile": compile_, "training.device": "cpu"}, world_size=1)
    torch.manual_seed(0)
    return cfg, Trainer(cfg, ParallelDims.from_config(cfg.parallel, 1).build_mesh(), torch.device("cpu"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", default="compile_speed.json", help="file name under bench/results/")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    cfg, eager = build(False)
    _, compiled = build(True)
    B, T, V = cfg.training.global_batch_size, cfg.data.seq_len, cfg.model.vocab_size
    times, losses = {"eager": [], "compiled": []}, {}
    for step in range(args.warmup + args.steps):
        g = torch.Generator().manual_seed(step)
        seq = torch.randint(0, V, (B, T + 1), generator=g)
        for name in ("eager", "compiled") if step % 2 == 0 else ("compiled", "eager"):
            tr = eager if name == "eager" else compiled
            t0 = time.perf_counter()
            out = tr.step(seq[:, :-1], seq[:, 1:])
            dt = time.perf_counter() - t0
            if step >= args.warmup:
                times[name].append(dt)
            losses[name] = out["loss"]
    med = {k: statistics.median(v) for k, v in times.items()}
    res = {"preset": "default", "batch": f"{B} x {T} tokens", "dtype": cfg.training.dtype,
           "threads": args.threads, "torch": torch.__version__, "steps": args.steps, "warmup": args.warmup,
           "eager_step_s": med["eager"], "compiled_step_s": med["compiled"],
           "eager_tokens_per_s": B * T / med["eager"], "compiled_tokens_per_s": B * T / med["compiled"],
           "ratio": med["eager"] / med["compiled"], "last_loss": losses,
           "load_before": load_before, "load_after": os.getloadavg()}
    from ndtrain.tools.bench_utils import write_result  # adds machine info and the UTC date

    write_result(ROOT / "bench" / "results" / args.out, res)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
