"""Every collective ndtrain issues, each taking an explicit ``AxisGroup`` and counting its bytes.

Counts are the bytes this rank sends under the ring algorithm (Patarasuk & Yuan 2009; ZeRO,
Rajbhandari 2020):

* all-reduce of S bytes over N ranks: 2 (N-1)/N * S
* all-gather producing S bytes:        (N-1)/N * S
* reduce-scatter consuming S bytes:    (N-1)/N * S
* all-to-all of S bytes (even split):  (N-1)/N * S
* send of S bytes:                      S

A size-1 group makes every function a no-op counting nothing. Every call runs under the flight
recorder's deadline (``CollectiveTimeoutError``). Autograd functions are named for their forward
effect with "fwd: X, bwd: Y" docstrings (Megatron-LM's f / g, Shoeybi et al. 2019)."""
from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

from ndtrain.mesh import AxisGroup
from ndtrain.parallel.flight_recorder import recorder, run_collective

# torch 2.13 renamed the flat-tensor collectives (the old names warn); older releases lack the new ones.
_ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


_COUNT_LOCK = threading.Lock()  # DualPipeV's overlapped pairs count from two threads (pp/runtime.py)


def count(group: AxisGroup, nbytes: float) -> None:
    with _COUNT_LOCK:
        group.stats[group.name] = group.stats.get(group.name, 0.0) + nbytes


def all_reduce(t: torch.Tensor, group: AxisGroup, op=dist.ReduceOp.SUM, async_op: bool = False):
    """In-place all-reduce of ``t`` over ``group``; returns a Work handle when ``async_op``."""
    if group.pg is None:
        return None
    n = group.size
    b = 2 * (n - 1) / n * nbytes(t)
    count(group, b)
    return run_collective("all_reduce", group, b,
                          lambda: dist.all_reduce(t, op=op, group=group.pg, async_op=True), async_op)


def _flat_collective(name: str, out: torch.Tensor, local: torch.Tensor, full: torch.Tensor,
                     group: AxisGroup, launch, async_op: bool):
    """All-gather / reduce-scatter between flat buffers: on one rank ``out`` <- ``local``; else
    (N-1)/N of ``full`` (the N*S buffer) is counted and ``launch()`` starts the collective."""
    if group.pg is None:
        out.copy_(local)
        return None
    b = (group.size - 1) / group.size * nbytes(full)
    count(group, b)
    return run_collective(name, group, b, launch, async_op)


def all_gather_into(out: torch.Tensor, shard: torch.Tensor, group: AxisGroup, async_op: bool = False):
    """``out`` (N*S,) <- concatenation over ranks of ``shard`` (S,); rank order along dim 0."""
    return _flat_collective("all_gather", out, shard, out, group,
                            lambda: _ALL_GATHER(out, shard, group=group.pg, async_op=True), async_op)


def reduce_scatter_into(out: torch.Tensor, full: torch.Tensor, group: AxisGroup,
                        op=dist.ReduceOp.SUM, async_op: bool = False):
    """``out`` (S,) <- this rank's slice of the sum over ranks of ``full`` (N*S,)."""
    return _flat_collective("reduce_scatter", out, full, full, group,
                            lambda: _REDUCE_SCATTER(out, full, op=op, group=group.pg, async_op=True), async_op)


def broadcast(t: torch.Tensor, group: AxisGroup, src_local_rank: int = 0) -> None:
    """In-place broadcast from the group's ``src_local_rank``; counted as S bytes on the source."""
    if group.pg is None:
        return
    if group.rank == src_local_rank:
        count(group, nbytes(t))
    run_collective("broadcast", group, nbytes(t),
                   lambda: dist.broadcast(t, group=group.pg, group_src=src_local_rank, async_op=True), False)


def all_reduce_scalar(value: float, group: AxisGroup, dtype=torch.float64,
                      op=dist.ReduceOp.SUM, device: torch.device | str = "cpu") -> float:
    """Sum (or ``op``) a Python scalar over the group; a convenience for counts and norms."""
    t = torch.tensor([value], dtype=dtype, device=device)
    all_reduce(t, group, op=op)
    return t.item()


# --- along a tensor dim: building blocks for the axes' autograd collectives ---
def gather_dim(x: torch.Tensor, dim: int, group: AxisGroup) -> torch.Tensor:
    """Concatenate ``x`` over the group's ranks along ``dim`` (rank order); counted as all-gather."""
    xs = x.movedim(dim, 0).contiguous()  # (S, ...) with the gathered dim first
    out = xs.new_empty((group.size * xs.shape[0],) + tuple(xs.shape[1:]))
    all_gather_into(out, xs, group)
    return out.movedim(0, dim)


def reduce_scatter_dim(x: torch.Tensor, dim: int, group: AxisGroup) -> torch.Tensor:
    """This rank's ``1/N`` slice along ``dim`` of the sum of ``x`` over ranks; counted as reduce-scatter."""
    if x.shape[dim] % group.size:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} is not divisible by {group.name} ({group.size})")
    xs = x.movedim(dim, 0).contiguous()  # (N*S, ...)
    out = xs.new_empty((xs.shape[0] // group.size,) + tuple(xs.shape[1:]))
    reduce_scatter_into(out, xs, group)
    return out.movedim(0, dim)


def split_dim(x: torch.Tensor, dim: int, group: AxisGroup) -> torch.Tensor:
    if x.shape[dim] % group.size:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} is not divisible by {group.name} ({group.size})")
    return x.chunk(group.size, dim)[group.rank].contiguous()


def all_gather_object(obj, group: AxisGroup) -> list:
    """Every rank's picklable ``obj`` in group-rank order (diagnostics, not the training path); counted as
    N x the pickled size. Bounded only by the process-group timeout (no async form)."""
    if group.pg is None:
        return [obj]
    import pickle

    out = [None] * group.size
    b = (group.size - 1) * len(pickle.dumps(obj))
    count(group, b)
    entry = recorder().start("all_gather_object", group.name, b)
    dist.all_gather_object(out, obj, group=group.pg)
    entry["t_end"] = time.time()
    return out
