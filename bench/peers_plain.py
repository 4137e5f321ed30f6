"""The PyTorch side of ``bench/peers.py``: an independent plain Llama and PyTorch's own parallelism.

The model is written here, not taken from ndtrain: RMSNorm, RoPE (theta 5e5, rotate-half), SDPA
causal attention with separate q / k / v projections (so DTensor's Colwise / Rowwise plans apply
as documented), SwiGLU, untied head, normal(0.02) init; ``F.cross_entropy``, AdamW (foreach),
gradient clipping at 1.0, bf16 autocast over fp32 weights. Layouts: ``plain`` (one process),
``ddp`` (``DistributedDataParallel``), ``fsdp2`` (``fully_shard`` per block, then the root), ``tp`` /
``tp_sp`` (``parallelize_module`` Colwise / Rowwise, + ``SequenceParallel`` and ``loss_parallel``),
``pp:<schedule>`` (``torch.distributed.pipelining``), ``cp`` (``context_parallel``).

``worker(rank, world, layout, steps, m)`` runs on a spawned rank (gloo group up) and returns
``step1_loss`` (global mean; None on ranks that do not hold it), ``step_s`` (wall seconds between
consecutive step ends, batch creation included) and ``params`` (this rank's parameter count).
"""
from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

DIM, LAYERS, HEADS, VOCAB, T, B, FFN = 256, 8, 8, 8192, 256, 8, 768
HD = DIM // HEADS


class Rope:
    """cos / sin (T, HD/2) shared by every attention (one tensor pair: ``context_parallel`` shards it once)."""

    def __init__(self):
        inv = 1.0 / (500000.0 ** (torch.arange(0, HD, 2).float() / HD))
        ang = torch.outer(torch.arange(T).float(), inv)
        self.cos, self.sin = ang.cos(), ang.sin()


def rotate(x, rope: Rope):
    x1, x2 = x.chunk(2, dim=-1)  # (B, T, H, HD/2) each
    c, s = rope.cos[: x.shape[1], None].to(x.dtype), rope.sin[: x.shape[1], None].to(x.dtype)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class Attention(nn.Module):
    def __init__(self, rope: Rope):
        super().__init__()
        self.rope = rope
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, HD) for w in (self.wq, self.wk, self.wv))  # local heads under TP
        q, k = rotate(q, self.rope), rotate(k, self.rope)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(a.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, FFN, bias=False), nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, rope: Rope):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM, eps=1e-5), nn.RMSNorm(DIM, eps=1e-5)
        self.attention, self.feed_forward = Attention(rope), FeedForward()

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """``first`` / ``last``: this pipeline chunk holds the embedding / the norm and head; ``layers``:
    which blocks (all by default)."""

    def __init__(self, layers=range(LAYERS), first: bool = True, last: bool = True, rope: Rope | None = None):
        super().__init__()
        self.rope = rope or Rope()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM) if first else None
        self.layers = nn.ModuleDict({str(i): Block(self.rope) for i in layers})
        self.norm = nn.RMSNorm(DIM, eps=1e-5) if last else None
        self.output = nn.Linear(DIM, VOCAB, bias=False) if last else None

    def forward(self, x):
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for blk in self.layers.values():
            h = blk(h)
        return self.output(self.norm(h)) if self.output is not None else h


def build(layers=range(LAYERS), first=True, last=True) -> Llama:
    """The chunk, initialised from the whole model's seeded weights (every layout starts alike)."""
    torch.manual_seed(0)
    whole = Llama()
    for p in whole.parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=0.02)
    part = Llama(layers, first, last)
    part.load_state_dict({k: v for k, v in whole.state_dict().items() if k in part.state_dict()})
    return part


def loss_fn(logits, y):
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def clip_(params, max_norm: float, group=None, sharded=lambda p: False) -> None:
    """Clip to the global norm: squares of sharded local gradients (and of every gradient over pp,
    ``group``) summed over ``group``; replicated ones counted once."""
    from torch.distributed.tensor import DTensor

    loc = [(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad) for p in params if p.grad is not None]
    part = torch.zeros(2, dtype=torch.float64)
    for p, g in zip([p for p in params if p.grad is not None], loc, strict=True):
        part[0 if sharded(p) else 1] += g.double().pow(2).sum()
    if group is not None:
        sq = part.clone()
        dist.all_reduce(sq[0:1], group=group)
        part = sq
    coef = max_norm / (math.sqrt(part.sum().item()) + 1e-6)
    if coef < 1:
        torch._foreach_mul_(loc, coef)


def adamw(params):
    """AdamW (foreach) per kind of parameter: one foreach call cannot mix DTensors and tensors."""
    from torch.distributed.tensor import DTensor

    kinds = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    opts = [torch.optim.AdamW(k, lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95), foreach=True) for k in kinds if k]

    def step():
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
    return step


def batch(step: int, rank_rows: slice):
    g = torch.Generator().manual_seed(step)
    seq = torch.randint(0, VOCAB, (B * 2, T + 1), generator=g)[rank_rows]
    return seq[:, :-1], seq[:, 1:]


def worker(rank: int, world: int, layout: str, steps: int, m: int = 4) -> dict:
    from bench import peers_layouts

    make = peers_layouts.LAYOUTS[layout.split(":")[0]]
    step_fn, params = make(rank, world, layout, m)
    ends, loss1 = [time.perf_counter()], None
    for s in range(steps):
        loss = step_fn(s)
        if s == 0:
            loss1 = loss
        ends.append(time.perf_counter())
    return {"step1_loss": loss1, "step_s": [b - a for a, b in zip(ends, ends[1:], strict=False)],
            "params": params, "threads": torch.get_num_threads()}
