"""Step time of ndtrain ZeRO-3 against PyTorch FSDP2 (``fully_shard``), in the same processes.

    python bench/zero_vs_fsdp2.py [--nproc 2] [--config default] [--override section.key=value ...]

Both sides train ndtrain's Transformer from the same preset on the same batches, with the same
units (embedding, each block, norm + output; one group with the embedding when tied; the head's
group kept gathered into backward as ``keep_last_unit_gathered``), AdamW, LR schedule, clipping,
microbatches and dtype
(bf16 runs: ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` for FSDP2). Steps
alternate A, B, A, B... so machine noise hits both; the median step time of each side and the
ratio ndtrain / FSDP2 (target <= 1.1) are reported, with ndtrain's traffic per step and axis.
Writes ``bench/results/zero_vs_fsdp2_<dtype>.json``.
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
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ndtrain.config import load_config
from ndtrain.mesh import ParallelDims
from ndtrain.model import build_model
from ndtrain.optim import build_optimizer, build_scheduler
from ndtrain.train.loop import Trainer


def _batch(cfg, step: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, cfg.model.vocab_size, (cfg.training.global_batch_size, cfg.data.seq_len), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _fsdp2_model(cfg):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build_model(cfg.model, "cpu", torch.float32, cfg.training.seed)
    kw = {}
    if cfg.training.dtype == "bfloat16":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kw["reshard_after_forward"] = cfg.parallel.reshard_after_forward
    # the unit holding the head stays gathered into backward when ndtrain keeps its last unit
    last = dict(kw, reshard_after_forward=kw["reshard_after_forward"] and not cfg.parallel.keep_last_unit_gathered)
    if cfg.model.tie_embeddings:  # the shared weight must live in one FSDP group (as in ndtrain)
        fully_shard([model.tok_embeddings, model.norm, model.output], **last)
    else:
        fully_shard(model.tok_embeddings, **kw)
        fully_shard([model.norm, model.output], **last)
    for block in model.layers.values():
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def _fsdp2_step(model, opt, sched, x, y, cfg, world: int) -> None:
    mb = cfg.training.micro_batch_size or x.shape[0]
    n = x.shape[0] // mb
    for i in range(n):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.training.dtype == "bfloat16"):
            logits = model(x[i * mb:(i + 1) * mb])
        loss = F.cross_entropy(logits.float().flatten(0, 1), y[i * mb:(i + 1) * mb].flatten(), reduction="sum")
        (loss / (x.numel() * world) * world).backward()  # FSDP2 averages over ranks
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.grad_clip)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


def _worker(rank: int, world: int, args) -> dict:
    import torch.distributed as dist

    over = dict(kv.split("=", 1) for kv in args.override)
    over["parallel.zero_stage"] = "3"
    cfg = load_config(args.config, over, world_size=world)
    mesh = ParallelDims.from_config(cfg.parallel, world).build_mesh()
    tr = Trainer(cfg, mesh, torch.device("cpu"))
    twin = _fsdp2_model(cfg)
    opt = build_optimizer(twin.named_parameters(), cfg.training)
    sched = build_scheduler(opt, cfg.training)
    local = cfg.training.global_batch_size // world
    times = {"ndtrain": [], "fsdp2": []}
    traffic = {}
    for step in range(args.warmup + args.steps):
        x, y = _batch(cfg, step)
        x, y = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
        for name in ("ndtrain", "fsdp2") if step % 2 == 0 else ("fsdp2", "ndtrain"):
            dist.barrier()
            mesh.reset_stats()
            t0 = time.perf_counter()
            if name == "ndtrain":
                tr.step(x, y)
                traffic = mesh.reset_stats()
            else:
                _fsdp2_step(twin, opt, sched, x, y, cfg, world)
            if step >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"ndtrain_step_s": med["ndtrain"], "fsdp2_step_s": med["fsdp2"],
            "ratio": med["ndtrain"] / med["fsdp2"], "steps": args.steps, "world": world,
            "dtype": cfg.training.dtype,
            "ndtrain_comm_bytes_per_step": traffic,
            "params": sum(p.numel() for p in tr.model.parameters())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--config", default="default")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--override", nargs="*", default=[], help="section.key=value")
    ap.add_argument("--out", default=None, help="result path (default bench/results/zero_vs_fsdp2_<dtype>.json)")
    args = ap.parse_args()
    from ndtrain.spawn import spawn

    threads = max(1, (os.cpu_count() or 2) // args.nproc)
    res = spawn(_worker, args.nproc, (args,), backend="gloo", threads=threads)[0]  # rank 0's numbers
    res.update(baseline="torch.distributed.fsdp.fully_shard (FSDP2), gloo", config=args.config,
               overrides=args.override, torch=torch.__version__)
    dest = Path(args.out) if args.out else ROOT / "bench" / "results" / f"zero_vs_fsdp2_{res['dtype']}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
