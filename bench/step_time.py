"""Step time of ndtrain against plain PyTorch, in the same command.

    python bench/step_time.py --mode single   # ndtrain Trainer vs a plain PyTorch loop, 1 process
    python bench/step_time.py --mode ddp      # ndtrain DataParallel vs torch DDP, 2 gloo processes

Both sides train the same model (ndtrain's Transformer from the same preset) on the same batches,
with the same optimizer, clipping and dtype; steps alternate A, B, A, B... so machine noise hits both
equally; the median step time of each side is reported with the ratio ndtrain / baseline (target
<= 1.05). Writes ``bench/results/step_time_<mode>.json``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ndtrain.config import load_config
from ndtrain.mesh import ParallelDims
from ndtrain.model import build_model
from ndtrain.train.loop import Trainer


def _batch(cfg, step: int, n: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, cfg.model.vocab_size, (n, cfg.data.seq_len), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _plain_step(model, opt, x, y, cfg, bf16: bool, ddp=None):
    mb = cfg.training.micro_batch_size or x.shape[0]
    n = x.shape[0] // mb
    net = ddp or model
    for i in range(n):
        ctx = ddp.no_sync() if (ddp is not None and i < n - 1) else contextlib.nullcontext()
        with ctx:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = net(x[i * mb:(i + 1) * mb])
            loss = F.cross_entropy(logits.float().flatten(0, 1), y[i * mb:(i + 1) * mb].flatten())
            (loss / n).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)


def measure(cfg, mesh, steps: int, warmup: int, rank: int = 0, world: int = 1) -> dict:
    tr = Trainer(cfg, mesh, torch.device("cpu"))
    base = build_model(cfg.model, "cpu", torch.float32, cfg.training.seed)
    ddp = torch.nn.parallel.DistributedDataParallel(base) if world > 1 else None
    opt = torch.optim.AdamW(base.parameters(), lr=cfg.training.lr, fused=False, foreach=True)
    bf16 = cfg.training.dtype == "bfloat16"
    local = cfg.training.global_batch_size // world
    times = {"ndtrain": [], "baseline": []}
    for step in range(warmup + steps):
        x, y = _batch(cfg, step, cfg.training.global_batch_size)
        x, y = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
        for name in ("ndtrain", "baseline") if step % 2 == 0 else ("baseline", "ndtrain"):
            t0 = time.perf_counter()
            if name == "ndtrain":
                tr.step(x, y)
            else:
                _plain_step(base, opt, x, y, cfg, bf16, ddp)
            if step >= warmup:
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"ndtrain_step_s": med["ndtrain"], "baseline_step_s": med["baseline"],
            "ratio": med["ndtrain"] / med["baseline"], "steps": steps}


def _ddp_worker(rank, world, args) -> dict:
    cfg = _cfg(args, world)
    mesh = ParallelDims.from_config(cfg.parallel, world).build_mesh()
    return measure(cfg, mesh, args.steps, args.warmup, rank, world)


def _cfg(args, world):
    over = dict(kv.split("=", 1) for kv in args.override)
    return load_config(args.config, over, world_size=world)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["single", "ddp"], default="single")
    ap.add_argument("--config", default="default")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--override", nargs="*", default=[], help="section.key=value")
    args = ap.parse_args()
    if args.mode == "single":
        res = measure(_cfg(args, 1), ParallelDims().build_mesh(), args.steps, args.warmup)
        res["baseline"] = "plain PyTorch loop (autocast, AdamW, clip_grad_norm_)"
    else:
        from ndtrain.spawn import spawn

        res = spawn(_ddp_worker, 2, (args,), backend="gloo", threads=max(1, (os.cpu_count() or 2) // 2))[0]
        res["baseline"] = "torch.nn.parallel.DistributedDataParallel, 2 gloo processes"
    res.update(mode=args.mode, config=args.config, overrides=args.override,
               threads=torch.get_num_threads(), torch=torch.__version__)
    dest = ROOT / "bench" / "results" / f"step_time_{args.mode}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
