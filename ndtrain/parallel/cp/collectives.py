"""Context parallel collectives: the Ulysses all-to-all (Jacobs et al. 2023) and the ring exchange
of ring attention (Liu et al. 2023), each counting its bytes on the cp axis.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ndtrain.mesh import AxisGroup
from ndtrain.parallel.comm import count, nbytes
from ndtrain.parallel.flight_recorder import run_batch_p2p, run_collective


def _all_to_all(x: torch.Tensor, group: AxisGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    n = group.size
    if x.shape[scatter_dim] % n:
        raise ValueError(f"all-to-all: dim {scatter_dim} of size {x.shape[scatter_dim]} is not "
                         f"divisible by {group.name} ({n})")
    send = torch.stack(x.chunk(n, scatter_dim)).contiguous()  # (N, ...) chunk i goes to rank i
    recv = torch.empty_like(send)
    b = (n - 1) / n * nbytes(send)
    count(group, b)
    run_collective("all_to_all", group, b,
                   lambda: dist.all_to_all_single(recv, send, group=group.pg, async_op=True), False)
    return torch.cat(recv.unbind(0), dim=gather_dim)  # chunks from ranks 0..N-1 in order


class AllToAll(torch.autograd.Function):
    """Re-shard from ``gather_dim`` to ``scatter_dim`` (DeepSpeed-Ulysses, Jacobs 2023). fwd: all-to-all;
    bwd: the inverse. Bytes: (N-1)/N * S per rank each way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: AxisGroup, scatter_dim: int, gather_dim: int):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        if group.pg is None:
            return x.view_as(x)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        if ctx.group.pg is None:
            return g, None, None, None
        s, gd = ctx.dims
        return _all_to_all(g.contiguous(), ctx.group, gd, s), None, None, None


def ring_exchange(send: torch.Tensor, group: AxisGroup, tag: int = 0):
    """Start sending ``send`` to the next ring rank and receiving the previous one's: (recv, works), recv
    valid after every work is waited on. Counts ``send``'s bytes. Raises ValueError on a size-1 group."""
    if group.pg is None:
        raise ValueError("ring_exchange needs a group of size > 1")
    send = send.contiguous()
    recv = torch.empty_like(send)
    nxt, prv = (group.rank + 1) % group.size, (group.rank - 1) % group.size
    ops = [dist.P2POp(dist.isend, send, group=group.pg, tag=tag, group_peer=nxt),
           dist.P2POp(dist.irecv, recv, group=group.pg, tag=tag, group_peer=prv)]
    count(group, nbytes(send))
    # one entry, one deadline: the send to ``nxt`` and the receive from ``prv`` (the peer blamed)
    return recv, [run_batch_p2p(f"ring_exchange(tag {tag})", group, nbytes(send),
                                lambda: dist.batch_isend_irecv(ops), peer=prv)]
