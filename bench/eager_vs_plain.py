"""ndtrain's eager Trainer against an independent plain PyTorch Llama loop, in one command.

    python bench/eager_vs_plain.py [--steps 10] [--warmup 2] [--mode single|ddp|both] [--fused-loss]

The baseline is written here, not taken from ndtrain: a Llama block with one fused QKV projection
and one fused gate / up projection (the layout fast single-file trainers use), SDPA attention,
RoPE, RMSNorm, untied head, ``F.cross_entropy``, AdamW (foreach), ``clip_grad_norm_``; torch DDP
for two processes. ndtrain's side is ``Trainer.step`` on its own ``Transformer`` with the same
shapes: dim 256, 8 layers, 8 heads, vocab 8192, 8 sequences x 256 tokens, bf16 autocast over fp32
weights. Steps alternate A, B, A, B (the order flips each step) on the same batches, so load on a
shared machine hits both sides alike; medians of the step times after warm-up. Writes
``bench/results/eager_vs_plain.json`` (ratio = ndtrain tokens/s / plain tokens/s; target >= 1.0)
with the machine's load average before and after.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DIM, LAYERS, HEADS, VOCAB, T, B, FFN = 256, 8, 8, 8192, 256, 8, 768


class PlainBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(DIM, eps=1e-5), nn.RMSNorm(DIM, eps=1e-5)
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)  # fused q / k / v
        self.wo = nn.Linear(DIM, DIM, bias=False)
        self.w13 = nn.Linear(DIM, 2 * FFN, bias=False)  # fused gate / up
        self.w2 = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, t, 3, HEADS, DIM // HEADS).unbind(2)  # (B, T, H, D) each
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, t, DIM))
        g, u = self.w13(self.n2(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(g) * u)


def rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)  # rotate-half pairs (i, i + D/2), (B, T, H, D/2) each
    c, s = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class PlainLlama(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(PlainBlock() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM, eps=1e-5)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        inv = 1.0 / (500000.0 ** (torch.arange(0, DIM // HEADS, 2).float() / (DIM // HEADS)))
        ang = torch.outer(torch.arange(T).float(), inv)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, x):
        h = self.emb(x)
        for blk in self.blocks:
            h = blk(h, self.cos, self.sin)
        return self.head(self.norm(h))


def plain_step(model, net, opt, x, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = net(x)
    F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def ndtrain_cfg(world: int, fused_loss: bool):
    from ndtrain.config import load_config

    over = {"model.dim": DIM, "model.n_layers": LAYERS, "model.n_heads": HEADS, "model.vocab_size": VOCAB,
            "model.ffn_hidden": FFN, "model.n_kv_heads": 0, "model.tie_embeddings": False,
            "model.rope_theta": 500000.0, "training.activation_checkpoint": "none", "data.seq_len": T, "training.global_batch_size": B,
            "training.micro_batch_size": 0, "training.dtype": "bfloat16", "training.device": "cpu",
            "training.fused_loss": fused_loss, "training.grad_clip": 1.0}
    return load_config("default", over, world_size=world)


def measure(steps: int, warmup: int, rank: int = 0, world: int = 1, fused_loss: bool = False) -> dict:
    from ndtrain.mesh import ParallelDims
    from ndtrain.train.trainer import Trainer

    cfg = ndtrain_cfg(world, fused_loss)
    tr = Trainer(cfg, ParallelDims.from_config(cfg.parallel, world).build_mesh(), torch.device("cpu"))
    torch.manual_seed(0)
    model = PlainLlama()
    net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95), foreach=True)
    local = B // world
    times = {"ndtrain": [], "plain": []}
    for step in range(warmup + steps):
        g = torch.Generator().manual_seed(step)
        seq = torch.randint(0, VOCAB, (B, T + 1), generator=g)[rank * local:(rank + 1) * local]
        x, y = seq[:, :-1], seq[:, 1:]
        for name in ("ndtrain", "plain") if step % 2 == 0 else ("plain", "ndtrain"):
            t0 = time.perf_counter()
            tr.step(x, y) if name == "ndtrain" else plain_step(model, net, opt, x, y)
            if step >= warmup:
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"ndtrain_step_s": med["ndtrain"], "plain_step_s": med["plain"],
            "ndtrain_tokens_per_s": B * T / med["ndtrain"], "plain_tokens_per_s": B * T / med["plain"],
            "ratio": med["plain"] / med["ndtrain"], "steps": steps, "warmup": warmup,
            "ndtrain_params": sum(p.numel() for p in tr.model.parameters()),
            "plain_params": sum(p.numel() for p in model.parameters())}


def _ddp_worker(rank: int, world: int, steps: int, warmup: int, fused_loss: bool) -> dict:
    return measure(steps, warmup, rank, world, fused_loss)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--mode", choices=("single", "ddp", "both"), default="both")
    ap.add_argument("--fused-loss", action="store_true", help="ndtrain side with training.fused_loss=true")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads of the one process "
                    "(DDP: this many split over the two ranks)")
    ap.add_argument("--out", default="eager_vs_plain.json", help="file name under bench/results/")
    args = ap.parse_args()
    res = {"model": f"dim {DIM}, {LAYERS} layers, {HEADS} heads, vocab {VOCAB}, ffn {FFN}",
           "batch": f"{B} x {T} tokens, bf16 autocast", "fused_loss": args.fused_loss,
           "torch": torch.__version__, "cores": os.cpu_count(), "threads": args.threads,
           "load_before": os.getloadavg()}
    if args.mode in ("single", "both"):
        torch.set_num_threads(args.threads)
        res["single"] = measure(args.steps, args.warmup, fused_loss=args.fused_loss)
        print("single", json.dumps(res["single"]), flush=True)
    if args.mode in ("ddp", "both"):
        from ndtrain.spawn import spawn

        threads = max(1, math.floor(args.threads / 2))
        out = spawn(_ddp_worker, 2, (args.steps, args.warmup, args.fused_loss), backend="gloo", threads=threads,
                    timeout_s=1800.0)
        res["ddp2"] = out[0]
        print("ddp2", json.dumps(res["ddp2"]), flush=True)
    res["load_after"] = os.getloadavg()
    path = ROOT / "bench" / "results" / args.out
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
