"""Blocking time of a checkpoint save: synchronous DCP save vs ``checkpoint.async_save``.

One process trains a model (AdamW, so the state is weights + two moments) and saves it every
``--every`` steps through ``ndtrain.checkpoint.dcp.CheckpointSaver``, once synchronously and once
asynchronously, alternating the two modes ``--rounds`` times in this command so machine load hits
both alike. Reports per mode the median ``block_s`` (how long ``save`` kept the training loop
waiting; for async: the copy to host memory plus waiting for the previous save), the median
``total_s`` (until the checkpoint was complete: manifest written, folder renamed), the wall time of
the whole loop, and the ratios async / sync. It also checks that the asynchronous checkpoint holds
exactly the state of its step (``consistent``): the training kept changing the weights while it
was written.

Usage: ``python bench/async_checkpoint.py [--dim 512] [--layers 8] [--steps 6] [--every 2]
[--rounds 2] [--device cpu|cuda]``; writes ``bench/results/async_checkpoint[_cuda].json``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ndtrain.checkpoint import dcp as ckpt
from ndtrain.config import ModelConfig
from ndtrain.events import read_events
from ndtrain.model import build_model


def _loop(mode: str, args, model, opt, run_dir: Path) -> dict:
    saver = ckpt.CheckpointSaver(run_dir / "checkpoints", keep_last=1, async_save=mode == "async",
                                 run_dir=run_dir)
    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(args.device)
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), x.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % args.every == 0:
            state = {"model": model.state_dict(), "optim": opt.state_dict()}
            saver.save(step, state, {"step": step})
    saver.wait()
    if args.device == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    events = read_events(run_dir, "checkpoint")
    return {"block_s": [e["block_s"] for e in events], "total_s": [e["total_s"] for e in events],
            "wall_s": wall}


def _consistent(args, model_cfg, tmp: Path) -> bool:
    """Async-save a model, change its weights in place at once, load the checkpoint: it must hold
    the weights of the moment of the save, bit for bit."""
    model = build_model(model_cfg, args.device, torch.float32, seed=1)
    want = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    saver = ckpt.CheckpointSaver(tmp / "consistency", keep_last=1, async_save=True)
    saver.save(1, {"model": model.state_dict()}, {"step": 1})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # while the background thread writes
    saver.wait()
    back = {k: torch.zeros_like(v) for k, v in want.items()}
    ckpt.load_tensors(tmp / "consistency" / "step_00000001", {"model": back})
    return all(torch.equal(back[k], want[k]) for k in want)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = ModelConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=8,
                      ffn_hidden=int(args.dim * 8 / 3) // 64 * 64, max_seq_len=args.seq, rope_theta=10000.0)
    out: dict[str, list] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory(prefix="ndtrain-async-ckpt-") as tmp:
        tmp = Path(tmp)
        for r in range(args.rounds):
            for mode in ("sync", "async") if r % 2 == 0 else ("async", "sync"):
                model = build_model(cfg, args.device, torch.float32, seed=0)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
                out[mode].append(_loop(mode, args, model, opt, tmp / f"{mode}{r}"))
        consistent = _consistent(args, cfg, tmp)
    n_params = sum(p.numel() for p in build_model(cfg, "meta", torch.float32, seed=0).parameters())

    def summary(mode):
        rows = out[mode]
        return {"block_s_median": statistics.median(b for r in rows for b in r["block_s"]),
                "total_s_median": statistics.median(t for r in rows for t in r["total_s"]),
                "loop_wall_s_median": statistics.median(r["wall_s"] for r in rows),
                "saves": sum(len(r["block_s"]) for r in rows)}

    s, a = summary("sync"), summary("async")
    result = {"config": vars(args), "params": n_params, "state_bytes": n_params * 4 * 3, "sync": s, "async": a,
              "block_ratio_async_vs_sync": round(a["block_s_median"] / s["block_s_median"], 4),
              "loop_wall_ratio_async_vs_sync": round(a["loop_wall_s_median"] / s["loop_wall_s_median"], 4),
              "consistent": consistent}
    path = Path(args.out or ROOT / "bench" / "results" /
                f"async_checkpoint{'_cuda' if args.device == 'cuda' else ''}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
