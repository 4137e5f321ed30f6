"""Collective timeouts and the flight recorder: every collective of ``comm`` and message of ``pp.p2p``
is recorded and waited for under a deadline (docs/fault_tolerance.md).

Otherwise a dead or hung peer blocks every rank with nothing saying who stopped. Like PyTorch's
NCCL flight recorder, each rank keeps its last N collectives in a ring buffer. Past
``parallel.collective_timeout_s`` a rank posts its state to the store, waits a grace period for
its peers', names those that did not post, writes ``RUN_DIR/flight_recorder/rank{r}.json``, logs a
``collective_timeout`` event and raises ``CollectiveTimeoutError``. The deadline is
``Work.wait(timeout)`` (gloo); on CUDA a timed CPU wait would serialise the host with every kernel,
so there the NCCL watchdog is the deadline. ``configure`` sets it per process; 600 s until then."""
from __future__ import annotations

import collections
import json
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist


class CollectiveTimeoutError(RuntimeError):
    """A collective or p2p missed ``parallel.collective_timeout_s``; names this rank, the suspects, the
    axis, the op and its sequence number."""


class FlightRecorder:
    """Ring buffer of the last ``capacity`` collectives (0 keeps none): ``seq``, ``op``, ``axis``,
    ``bytes``, ``t_start`` / ``t_end`` (Unix seconds; ``t_end`` None while in flight)."""

    def __init__(self, capacity: int = 256, timeout_s: float = 600.0, run_dir: str | Path | None = None,
                 grace_s: float | None = None):
        self.entries: collections.deque = collections.deque(maxlen=max(capacity, 1))
        self.capacity, self.timeout_s = capacity, float(timeout_s)
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.grace_s = grace_s if grace_s is not None else min(10.0, max(1.0, 0.5 * self.timeout_s))
        self.seq = 0
        self.wait_s = 0.0  # seconds the main thread spent blocked in waits (``add_wait``)
        self._lock = threading.Lock()  # pipeline receiver threads record too

    def start(self, op: str, axis: str, nbytes: float, peer: int | None = None) -> dict:
        """Record a collective being issued (``peer``: a p2p's group-local other end); returns its entry."""
        with self._lock:
            self.seq += 1
            entry = {"seq": self.seq, "op": op, "axis": axis, "bytes": int(nbytes),
                     "t_start": time.time(), "t_end": None, "peer": peer}
            if self.capacity:
                self.entries.append(entry)
        return entry

    def wait(self, work, entry: dict, group) -> None:
        """``work.wait()`` under the deadline; raises ``CollectiveTimeoutError`` on timeout."""
        if work is None:
            return
        t0 = time.perf_counter()
        if _uses_timeout(group):
            try:
                work.wait(timeout=timedelta(seconds=self.timeout_s))
            except RuntimeError as e:
                if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
                    raise
                raise self.timeout_error(entry, group) from e
        else:
            work.wait()
        entry["t_end"] = time.time()
        self.add_wait(time.perf_counter() - t0)

    def add_wait(self, seconds: float) -> None:
        """Add ``seconds`` to ``wait_s`` only on the main thread: receiver and overlap threads wait beside
        the step, not in it (the straggler report subtracts ``wait_s`` from wall time)."""
        if threading.current_thread() is threading.main_thread():
            with self._lock:
                self.wait_s += seconds

    def timeout_error(self, entry: dict, group) -> CollectiveTimeoutError:
        """Post this rank's state, find the peers that did not, dump the buffer; the error to raise."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        suspects = _suspects(group, rank, entry, self.grace_s)
        path = self.dump(rank)
        if suspects is None:
            who = "the peers could not be polled (the store's host, rank 0, may be gone)"
        elif suspects:
            who = f"rank(s) {suspects} never reached or finished it (hung or dead)"
        else:
            who = "every peer of the group timed out too (a peer outside it may be stuck)"
        msg = (f"rank {rank}: collective {entry['op']} #{entry['seq']} on mesh axis '{entry['axis']}' "
               f"({entry['bytes']} bytes) did not finish within parallel.collective_timeout_s="
               f"{self.timeout_s:g} s; {who}" + (f"; flight recorder: {path}" if path else ""))
        if self.run_dir is not None:
            from ndtrain.events import log_event

            log_event(self.run_dir, "collective_timeout", rank=rank, axis=entry["axis"], op=entry["op"],
                      seq=entry["seq"], suspects=suspects, timeout_s=self.timeout_s)
        return CollectiveTimeoutError(msg)

    def dump(self, rank: int) -> Path | None:
        """Write the buffer to ``RUN_DIR/flight_recorder/rank{rank}.json``; None without a run dir."""
        if self.run_dir is None:
            return None
        path = self.run_dir / "flight_recorder" / f"rank{rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            entries = [dict(e) for e in self.entries]
        path.write_text(json.dumps({"rank": rank, "timeout_s": self.timeout_s, "entries": entries}, indent=1))
        return path


def _uses_timeout(group) -> bool:
    pg = getattr(group, "pg", None)
    try:
        return pg is not None and dist.get_backend(pg) == "gloo"
    except (RuntimeError, ValueError):
        return False


def _suspects(group, rank: int, entry: dict, grace_s: float) -> list[int] | None:
    """Ranks of ``group`` that posted no timeout within ``grace_s``; None when the store cannot tell."""
    try:
        store = dist.distributed_c10d._get_default_store()
        peers = (dist.get_process_group_ranks(group.pg) if entry.get("peer") is None
                 else [dist.get_global_rank(group.pg, entry["peer"])])
        prefix = f"ndtrain/timeout/{group.name}/"
        store.set(prefix + str(rank), json.dumps({"seq": entry["seq"], "op": entry["op"]}))
        missing = [p for p in peers if p != rank]
        deadline = time.monotonic() + grace_s
        while missing and time.monotonic() < deadline:
            missing = [p for p in missing if not store.check([prefix + str(p)])]
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - diagnosis only: the timeout error is raised regardless
        return None
    return missing


RECORDER = FlightRecorder()


def configure(timeout_s: float, capacity: int, run_dir: str | Path | None) -> FlightRecorder:
    """Set this process's deadline, buffer size and run directory; returns the recorder."""
    global RECORDER
    RECORDER = FlightRecorder(capacity, timeout_s, run_dir)
    return RECORDER


def recorder() -> FlightRecorder:
    return RECORDER


class _WorkList:
    """Several Works (one ``batch_isend_irecv``) waited on as one, under one deadline."""

    def __init__(self, works):
        self.works = list(works or [])

    def wait(self, timeout=None) -> bool:
        for w in self.works:
            w.wait(timeout=timeout) if timeout is not None else w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def run_batch_p2p(op: str, group, nbytes: float, launch, peer: int | None = None) -> TimedWork:
    """``run_collective`` for a ``batch_isend_irecv`` (list of Works): one entry, one deadline."""
    rec = RECORDER
    entry = rec.start(op, group.name, nbytes, peer)
    return TimedWork(rec, _WorkList(launch()), entry, group)


class TimedWork:
    """An async collective's Work whose ``wait()`` applies the deadline and closes its entry."""

    def __init__(self, rec: FlightRecorder, work, entry: dict, group):
        self.rec, self.work, self.entry, self.group = rec, work, entry, group

    def wait(self, timeout=None) -> bool:
        self.rec.wait(self.work, self.entry, self.group)
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed()


def run_collective(op: str, group, nbytes: float, launch, async_op: bool, peer: int | None = None):
    """Issue ``launch()`` (an ``async_op=True`` collective) under the recorder: a ``TimedWork`` when
    ``async_op``, else wait here. ``peer``: a p2p's other end, the only rank a timeout can blame."""
    rec = RECORDER
    entry = rec.start(op, group.name, nbytes, peer)
    work = launch()
    if async_op:
        return TimedWork(rec, work, entry, group)
    rec.wait(work, entry, group)
    return None
