"""Point-to-point messages between pipeline stages: a fixed header (dtype, shape), then the tensor.

``send_tensor`` posts both sends (counted on pp); ``recv_tensor`` blocks (the 1F1B reference);
``Receiver`` runs one thread per peer posting its receives in that peer's send order, so messages
land while the main thread computes. No shape knowledge is needed (uneven microbatches, sp / cp
shards). Every message waits under ``parallel.collective_timeout_s`` (``flight_recorder``): a peer
that never sends raises ``CollectiveTimeoutError`` naming both ranks and the pp axis."""
from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

from ndtrain.mesh import AxisGroup
from ndtrain.parallel.comm import count, nbytes
from ndtrain.parallel.flight_recorder import recorder, run_collective

_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32]
_META_LEN = 8  # dtype code, ndim, up to 6 dims


def send_async(t: torch.Tensor, group: AxisGroup, dst_local_rank: int, tag: int = 0):
    """Post an async send of ``t`` (keep it alive and unmodified until done) to ``dst_local_rank``;
    counted on the sender. Raises RuntimeError on a size-1 group."""
    if group.pg is None:
        raise RuntimeError(f"send on size-1 group {group.name!r}")
    count(group, nbytes(t))
    t = t.contiguous()
    return run_collective(f"send(to {group.name} rank {dst_local_rank}, tag {tag})", group, nbytes(t),
                          lambda: dist.isend(t, group=group.pg, group_dst=dst_local_rank, tag=tag), True,
                          peer=dst_local_rank)


def recv_async(t: torch.Tensor, group: AxisGroup, src_local_rank: int, tag: int = 0):
    """Post an async receive into the preallocated ``t`` from ``src_local_rank`` (uncounted: the sender
    counts)."""
    if group.pg is None:
        raise RuntimeError(f"recv on size-1 group {group.name!r}")
    return run_collective(f"recv(from {group.name} rank {src_local_rank}, tag {tag})", group, nbytes(t),
                          lambda: dist.irecv(t, group=group.pg, group_src=src_local_rank, tag=tag), True,
                          peer=src_local_rank)


def tag(kind: str, mb: int, stage: int, n_stages: int) -> int:
    """Header tag of message (kind "F" | "B", microbatch, receiving stage); the tensor uses ``tag + 1``."""
    return ((mb * n_stages + stage) * 2 + (kind == "B")) * 2


class Receiver:
    """One thread per peer: receives that peer's messages (header, then tensor) in send order."""

    def __init__(self, group: AxisGroup, device: torch.device, timeout_s: float):
        # the receive threads' own deadline (collective_timeout_s) fires first: its error names the peer
        rec = recorder()
        self.group, self.device = group, device
        self.timeout_s = max(timeout_s, rec.timeout_s + rec.grace_s + 5.0)
        self.inbox: dict[tuple, torch.Tensor] = {}
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self.threads: list[threading.Thread] = []

    def start(self, peer: int, keys: list[tuple[tuple, int]]) -> None:
        """Receive ``keys`` = [(message key, header tag), ...] from ``peer``, in that order."""
        th = threading.Thread(target=self._loop, args=(peer, keys), daemon=True)
        th.start()
        self.threads.append(th)

    def _loop(self, peer: int, keys) -> None:
        try:
            for key, msg_tag in keys:
                buf = recv_tensor(self.group, peer, msg_tag, self.device)
                with self.cond:
                    self.inbox[key] = buf
                    self.cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread by take()
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def take(self, key: tuple) -> torch.Tensor:
        """Message ``key``, blocking until it arrives; the wait counts as the step's idle time
        (``add_wait``)."""
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        try:
            with self.cond:
                while key not in self.inbox:
                    if self.error is not None:
                        raise RuntimeError(f"pipeline receive failed: {self.error!r}") from self.error
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"pipeline: message {key} did not arrive in {self.timeout_s:.0f} s")
                    self.cond.wait(timeout=min(left, 1.0))
                return self.inbox.pop(key)
        finally:
            recorder().add_wait(time.monotonic() - t0)

    def join(self) -> None:
        for th in self.threads:
            th.join(timeout=self.timeout_s)
        self.threads.clear()
        if self.error is not None:
            raise RuntimeError(f"pipeline receive failed: {self.error!r}") from self.error


def send_tensor(t: torch.Tensor, group: AxisGroup, dst: int, msg_tag: int):
    """Post header + tensor sends to ``dst``; returns (works, buffers to keep alive until done)."""
    t = t.detach().contiguous()
    meta = torch.zeros(_META_LEN, dtype=torch.int64)
    meta[0], meta[1] = _DTYPES.index(t.dtype), t.dim()
    meta[2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    works = (send_async(meta, group, dst, msg_tag), send_async(t, group, dst, msg_tag + 1))
    return works, (meta, t)


def recv_tensor(group: AxisGroup, src: int, msg_tag: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Blocking receive of one message (header, then tensor) from ``src``."""
    meta = torch.empty(_META_LEN, dtype=torch.int64)
    recv_async(meta, group, src, msg_tag).wait()
    ndim = int(meta[1])
    shape = [int(d) for d in meta[2:2 + ndim]]
    buf = torch.empty(shape, dtype=_DTYPES[int(meta[0])], device=device)
    recv_async(buf, group, src, msg_tag + 1).wait()
    return buf
