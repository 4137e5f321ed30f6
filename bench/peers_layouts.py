"""PyTorch's own layouts of ``bench/peers_plain.py``'s Llama, each ``make(rank, world, layout, m)`` ->
``(step(s) -> step-1-style global loss or None, this rank's parameter count)``."""
from __future__ import annotations

import torch
import torch.distributed as dist

from bench.peers_plain import LAYERS, B, adamw, batch, build, clip_, loss_fn

AUTOCAST = dict(device_type="cpu", dtype=torch.bfloat16)


def _count(model) -> int:
    from torch.distributed.tensor import DTensor

    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())


def _mean_over(loss: torch.Tensor, world: int) -> float:
    t = loss.detach().double().reshape(1)
    if world > 1:
        dist.all_reduce(t)
    return (t / world).item()


def plain(rank, world, layout, m):
    """One process, or DDP / FSDP2 over all ranks (each its own B sequences)."""
    model = build()
    net = model
    if layout == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model)
    elif layout == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for blk in model.layers.values():
            fully_shard(blk)
        fully_shard(model)
    opt = adamw(list(model.parameters()))
    rows = slice(rank * B, (rank + 1) * B)

    def step(s):
        x, y = batch(s, rows)
        with torch.autocast(**AUTOCAST):
            logits = net(x)
        loss = loss_fn(logits, y)
        loss.backward()
        if layout == "fsdp2":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # DTensor norm over the shards
        else:
            clip_(list(model.parameters()), 1.0)
        opt()
        return _mean_over(loss, world) if s == 0 else None
    return step, _count(model)


def tp(rank, world, layout, m):
    """DTensor tensor parallel over all ranks (the same B sequences each); ``tp_sp`` adds sequence
    parallel norms and the vocab-parallel loss for both."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        loss_parallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world,))
    sp = layout == "tp_sp"
    model = build()
    seq = Shard(1) if sp else Replicate()
    top = {"output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)}
    if sp:
        top |= {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                "norm": SequenceParallel()}
    parallelize_module(model, mesh, top)
    for blk in model.layers.values():
        plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=seq),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=seq)}
        if sp:
            plan |= {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                     "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                     "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                        desired_input_layouts=(Replicate(),))}
        parallelize_module(blk, mesh, plan)
    params = list(model.parameters())
    opt = adamw(params)

    def sharded(p):
        return isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements)

    def step(s):
        x, y = batch(s, slice(0, B))
        with torch.autocast(**AUTOCAST):
            logits = model(x)
        with loss_parallel():
            loss = loss_fn(logits, y)
            loss.backward()
        clip_(params, 1.0, group=mesh.get_group(), sharded=sharded)
        opt()
        if s == 0:
            return (loss.full_tensor() if isinstance(loss, DTensor) else loss).item()
        return None
    return step, _count(model)


def pp(rank, world, layout, m):
    """``torch.distributed.pipelining`` over all ranks: ``pp:gpipe`` / ``pp:1f1b`` (one stage per rank),
    ``pp:interleaved`` (two per rank, looped), ``pp:zero_bubble`` (InterleavedZeroBubble, one per rank),
    ``pp:zbv`` / ``pp:dualpipev`` (two per rank in a V)."""
    from torch.distributed import pipelining as pl

    kind = layout.split(":")[1]
    per_rank = 2 if kind in ("interleaved", "zbv", "dualpipev") else 1
    n = world * per_rank
    if kind in ("zbv", "dualpipev"):
        ids = [rank, n - 1 - rank]
    else:
        ids = [rank + c * world for c in range(per_rank)]
    per = LAYERS // n
    chunks = [build(range(i * per, (i + 1) * per), first=i == 0, last=i == n - 1) for i in ids]
    stages = [pl.PipelineStage(c, i, n, torch.device("cpu")) for c, i in zip(chunks, ids, strict=True)]
    cls = {"gpipe": pl.ScheduleGPipe, "1f1b": pl.Schedule1F1B, "interleaved": pl.ScheduleInterleaved1F1B,
           "zero_bubble": pl.ScheduleInterleavedZeroBubble, "zbv": pl.ScheduleZBVZeroBubble,
           "dualpipev": pl.ScheduleDualPipeV}[kind]
    single = kind in ("gpipe", "1f1b")
    sched = cls(stages[0] if single else stages, n_microbatches=m, loss_fn=loss_fn)
    params = [p for c in chunks for p in c.parameters()]
    opt = adamw(params)
    has_first, has_last = 0 in ids, n - 1 in ids

    def step(s):
        x, y = batch(s, slice(0, B))
        losses: list = []
        args = (x,) if has_first else ()
        kw = {"target": y, "losses": losses} if has_last else {}
        with torch.autocast(**AUTOCAST):
            sched.step(*args, **kw)
        clip_(params, 1.0, group=dist.group.WORLD, sharded=lambda p: True)  # each rank its own layers
        opt()
        if s == 0 and has_last:
            return torch.stack([v.detach().float() for v in losses]).mean().item()
        return None
    return step, sum(p.numel() for p in params)


def cp(rank, world, layout, m):
    """``context_parallel`` over all ranks: the same B sequences, each rank a slice of every one."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (world,))
    model = build()
    opt = adamw(list(model.parameters()))

    def step(s):
        x, y = batch(s, slice(0, B))
        rope = model.rope
        with context_parallel(mesh, buffers=[x, y, rope.cos, rope.sin], buffer_seq_dims=[1, 1, 0, 0]):
            with torch.autocast(**AUTOCAST):
                logits = model(x)
            loss = loss_fn(logits, y)
            loss.backward()
        for p in model.parameters():  # each rank's gradient of its slice: sum them (equal slices)
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= world
        clip_(list(model.parameters()), 1.0)
        opt()
        return _mean_over(loss, world) if s == 0 else None
    return step, _count(model)


LAYOUTS = {"plain": plain, "ddp": plain, "fsdp2": plain, "tp": tp, "tp_sp": tp, "pp": pp, "cp": cp}
