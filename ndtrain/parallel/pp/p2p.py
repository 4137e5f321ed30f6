"""Point-to-point messages between pipeline stages: a fixed header (dtype, shape), then the tensor.

``send_tensor`` posts both sends asynchronously (``send_async``, counted on the pp axis);
``recv_tensor`` receives one message, blocking (the plain 1F1B reference executor uses it);
``Receiver`` runs one thread per peer that posts that peer's receives in the order the peer sends
them (known from the schedule), so messages land while the main thread computes; ``take(key)``
blocks only until that message is there (or raises after ``timeout_s``, or re-raises a receive
error). Receivers need no shape knowledge: microbatches of different sizes and sequence / context
parallel shards all work.

Every send and receive is recorded by the flight recorder and its ``wait()`` runs under
``parallel.collective_timeout_s`` (``ndtrain.parallel.flight_recorder``): a peer that never sends
makes the receiver raise ``CollectiveTimeoutError`` naming both ranks and the ``pp`` axis.
"""
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
    """Post an asynchronous send of ``t`` to the group's ``dst_local_rank``; returns the Work.

    ``t`` must stay alive and unmodified until the Work completes. Counted: S bytes on the sender.
    Raises RuntimeError on a size-1 group (a pipeline stage never sends to itself).
    """
    if group.pg is None:
        raise RuntimeError(f"send on size-1 group {group.name!r}")
    count(group, nbytes(t))
    t = t.contiguous()
    return run_collective(f"send(to {group.name} rank {dst_local_rank}, tag {tag})", group, nbytes(t),
                          lambda: dist.isend(t, group=group.pg, group_dst=dst_local_rank, tag=tag), True,
                          peer=dst_local_rank)


def recv_async(t: torch.Tensor, group: AxisGroup, src_local_rank: int, tag: int = 0):
    """Post an asynchronous receive into ``t`` (preallocated, exact size and dtype) from the group's
    ``src_local_rank``; returns the Work. Not counted (the sender counts the bytes)."""
    if group.pg is None:
        raise RuntimeError(f"recv on size-1 group {group.name!r}")
    return run_collective(f"recv(from {group.name} rank {src_local_rank}, tag {tag})", group, nbytes(t),
                          lambda: dist.irecv(t, group=group.pg, group_src=src_local_rank, tag=tag), True,
                          peer=src_local_rank)


def tag(kind: str, mb: int, stage: int, n_stages: int) -> int:
    """Tag of the header of message (kind "F" activation | "B" gradient, microbatch, receiving
    virtual stage); the tensor itself goes with ``tag + 1``. Unique within a step."""
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
        """The message ``key``, blocking until it arrives; the time blocked counts as a wait of the
        step (``FlightRecorder.add_wait``: a stage waiting for its neighbour is idle, not slow)."""
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
    """Blocking receive of one message from ``src``: the header (dtype, shape), then the tensor."""
    meta = torch.empty(_META_LEN, dtype=torch.int64)
    recv_async(meta, group, src, msg_tag).wait()
    ndim = int(meta[1])
    shape = [int(d) for d in meta[2:2 + ndim]]
    buf = torch.empty(shape, dtype=_DTYPES[int(meta[0])], device=device)
    recv_async(buf, group, src, msg_tag + 1).wait()
    return buf
