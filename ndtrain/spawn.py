"""``spawn``: the one helper starting local ranks (trainer, planner measurements, tests, benchmarks).

Each rank is a fresh interpreter (multiprocessing "spawn": CUDA-safe) with the torchrun
environment, an optional default process group and a result file. Failures come back as one
``SpawnError`` blaming one rank, with its traceback once. Torch is imported only inside ranks.

The thread policy of every launch lives here too (``thread_policy``): one process, spawned ranks
and torchrun workers all compute with the cores of the node shared by its local ranks, capped by
an ``OMP_NUM_THREADS`` of the launching environment (with a warning in the start-up summary)."""
from __future__ import annotations

import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import get_context
from multiprocessing.connection import wait
from pathlib import Path


class SpawnError(RuntimeError):
    """A rank failed, died or hung. ``rank``: the one to blame (None if several hung); ``details``: its
    traceback ("" if none); ``exitcode``: negative for a signal, None when unknown."""

    def __init__(self, message: str, rank: int | None = None, details: str = "", exitcode: int | None = None):
        super().__init__(message)
        self.rank, self.details, self.exitcode = rank, details, exitcode


THREAD_POLICY_ENV = "NDTRAIN_THREAD_POLICY"  # the launcher's policy, handed to its ranks (``apply_policy``)


@dataclass(frozen=True)
class ThreadPolicy:
    """Compute threads of one rank: the cores this process may run on (``os.sched_getaffinity``)
    shared evenly by the ``local_ranks`` of the node, at least 1; an ``OMP_NUM_THREADS`` in the
    launching environment (torchrun sets 1) caps it, with a ``warning`` when the cap is lower."""

    cores: int  # cores of the node this launch may use
    local_ranks: int  # ranks sharing them
    cap: int | None  # OMP_NUM_THREADS of the launching environment (None: unset / not a number)

    @property
    def given(self) -> int:
        """Cores one rank was given."""
        return max(1, self.cores // self.local_ranks)

    @property
    def threads(self) -> int:
        return min(self.given, self.cap) if self.cap else self.given

    def warning(self) -> str | None:
        if not self.cap or self.cap >= self.given:
            return None
        return (f"warning: OMP_NUM_THREADS={self.cap} in the environment caps each rank at {self.cap} compute "
                f"thread(s), below the {self.given} core(s) it was given ({self.cores} cores / "
                f"{self.local_ranks} local rank(s)); unset it or raise it to use them")

    def describe(self, live: int | None = None) -> str:
        """The start-up summary line; ``live``: ``torch.get_num_threads()`` when it differs."""
        src = f"capped by OMP_NUM_THREADS={self.cap}" if self.cap and self.cap < self.given else "from the cores"
        line = f"threads: {self.threads} per rank ({self.cores} cores / {self.local_ranks} local rank(s), {src})"
        return line + (f"; torch uses {live} (set after start-up)" if live is not None and live != self.threads
                       else "")


def thread_policy(local_ranks: int, env=None, cores: int | None = None) -> ThreadPolicy:
    """The one thread policy of every launch (one process, spawned ranks, torchrun workers).

    ``local_ranks``: processes of this node sharing its cores; ``env``: the launching environment
    (default ``os.environ``); ``cores``: default the affinity of this process. Raises ValueError
    for ``local_ranks`` < 1."""
    if local_ranks < 1:
        raise ValueError(f"local_ranks ({local_ranks}) must be >= 1")
    env = os.environ if env is None else env
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    raw = env.get("OMP_NUM_THREADS", "").strip()
    cap = int(raw) if raw.isdigit() and int(raw) > 0 else None
    return ThreadPolicy(max(1, cores), local_ranks, cap)


def policy_env(policy: ThreadPolicy) -> dict[str, str]:
    """What a spawned rank's environment carries of ``policy`` (read back by ``current_policy``);
    ``spawn(threads=policy.threads)`` sets its threads."""
    return {THREAD_POLICY_ENV: f"{policy.cores},{policy.local_ranks},{policy.cap or 0}"}


_CURRENT: ThreadPolicy | None = None  # set by ``running_under`` in this process


def current_policy() -> ThreadPolicy:
    """The policy this process runs under: ``running_under``'s, else its launcher's (``policy_env``),
    else that of one of ``LOCAL_WORLD_SIZE`` local ranks (default 1)."""
    if _CURRENT is not None:
        return _CURRENT
    try:
        cores, ranks, cap = (int(x) for x in os.environ.get(THREAD_POLICY_ENV, "").split(","))
        return ThreadPolicy(cores, ranks, cap or None)
    except ValueError:
        return thread_policy(int(os.environ.get("LOCAL_WORLD_SIZE", "") or 1))


@contextmanager
def running_under(policy: ThreadPolicy):
    """Inside the block this process computes with ``policy.threads`` torch threads and reports
    ``policy`` (``current_policy``); both are restored after it."""
    import torch

    global _CURRENT
    old = torch.get_num_threads(), _CURRENT
    _CURRENT = policy
    torch.set_num_threads(policy.threads)
    try:
        yield policy
    finally:
        _CURRENT = old[1]
        torch.set_num_threads(old[0])


def free_port() -> int:
    """A free 127.0.0.1 TCP port (another process may take it first; ``spawn`` retries)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, nprocs: int, args: tuple = (), *, backend: str | None = None, threads: int | None = None,
          timeout_s: float | None = None, env: dict[str, str] | None = None,
          group_timeout_s: float = 600.0) -> list:
    """Run ``fn(rank, nprocs, *args)`` in ``nprocs`` fresh processes; return the per-rank results.

    Each rank gets ``MASTER_ADDR`` / ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and
    ``env``; ``threads`` sets its thread count. With ``backend`` the helper owns the default process
    group (timeout ``group_timeout_s``). ``fn`` (module level), ``args`` and results must pickle. Ranks
    ignore SIGINT and exit within a second if the parent dies.

    Raises SpawnError when a rank raised (``details``: its traceback), died without a Python error, or
    ranks ran past ``timeout_s`` (then all are killed and named)."""
    for attempt in range(3):
        try:
            return _spawn_once(fn, nprocs, args, backend, threads, timeout_s, env or {}, group_timeout_s)
        except SpawnError as e:  # the free port was taken before rank 0 bound it: pick another
            if attempt == 2 or "address already in use" not in e.details.lower():
                raise
    raise AssertionError("unreachable")


def _spawn_once(fn, nprocs, args, backend, threads, timeout_s, env, group_timeout_s) -> list:
    ctx = get_context("spawn")
    base = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nprocs))
    if threads:
        base["OMP_NUM_THREADS"] = str(threads)
    procs = []
    with tempfile.TemporaryDirectory(prefix="ndtrain-ranks-") as out_dir:
        try:
            for rank in range(nprocs):
                procs.append(ctx.Process(target=_rank_entry, name=f"ndtrain-rank{rank}", args=(
                    rank, nprocs, out_dir, fn, args, backend, threads, group_timeout_s, os.getpid())))
                with environ(dict(base, RANK=str(rank), LOCAL_RANK=str(rank))), _sigint_ignored():
                    procs[-1].start()  # the child inherits this environment and the ignored SIGINT
            _wait(procs, out_dir, timeout_s)
        except BaseException as e:  # a failed / hung rank, Ctrl-C: no rank may outlive this call
            codes = [p.exitcode for p in procs]  # before stop_processes adds its own SIGTERM / SIGKILL
            stop_processes(procs)
            if isinstance(e, SpawnError) and e.rank is not None:
                raise _blame(procs, out_dir, e.rank, codes) from None
            raise
        return [_read(out_dir, r)[1] for r in range(nprocs)]


def _rank_entry(rank, world, out_dir, fn, args, backend, threads, group_timeout_s, parent_pid):
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    if threads:
        import torch

        torch.set_num_threads(threads)
    try:
        if backend:
            import torch.distributed as dist

            dist.init_process_group(backend, rank=rank, world_size=world,
                                    timeout=timedelta(seconds=group_timeout_s))
        result = fn(rank, world, *args)
        if backend:
            dist.barrier()  # no rank tears the group down while another still communicates
        payload = pickle.dumps(("ok", result))
    # BaseException: torch.distributed.checkpoint raises CheckpointException, which is not an
    # Exception; it too must reach the launcher as this rank's error, not as a bare exit code.
    except BaseException:  # noqa: BLE001 - handed to the launcher, which reports the first failing rank once
        _write(out_dir, rank, pickle.dumps(("error", traceback.format_exc(), time.time())))
        _exit_now(1)  # no group teardown: it can block on peers that are gone; the OS frees it all
    _write(out_dir, rank, payload)
    dist = sys.modules.get("torch.distributed")  # fn may have created the group itself
    if dist is not None and dist.is_initialized():
        dist.destroy_process_group()
    _exit_now(0)


def _exit_now(code: int) -> None:
    """End a rank without interpreter finalization. Meshes and groups of ``fn`` may still hold gloo
    process groups; destroyed during finalization, their worker threads can abort the process
    (SIGABRT, "terminate called without an active exception") after the rank's work is done."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _write(out_dir: str, rank: int, payload: bytes) -> None:
    tmp = Path(out_dir) / f"rank{rank}.tmp"
    tmp.write_bytes(payload)
    tmp.rename(Path(out_dir) / f"rank{rank}.pkl")


def _exit_with_parent(parent_pid: int) -> None:
    """Rank watchdog: exit at once if the launcher died, so no rank trains on alone."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)


@contextmanager
def environ(updates: dict[str, str]):
    """``os.environ`` updated by ``updates`` inside the block, restored (or unset) after it."""
    old = {k: os.environ.get(k) for k in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def _sigint_ignored():
    """Ranks start with SIGINT ignored: Ctrl-C reaches the whole terminal process group, and only the
    launcher should react (by stopping the ranks)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def _wait(procs, out_dir: str, timeout_s: float | None) -> None:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    alive = dict(enumerate(procs))
    while alive:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            hung = ", ".join(map(str, alive))
            raise SpawnError(f"rank(s) {hung} of {len(procs)} did not finish within {timeout_s:.0f} s "
                             f"(hung?); all ranks were stopped")
        wait([p.sentinel for p in alive.values()], timeout=left)
        for r, p in list(alive.items()):
            if p.exitcode is not None:
                del alive[r]
                if p.exitcode != 0:
                    raise SpawnError(f"rank {r} failed", rank=r)


def stop_processes(procs, grace_s: float = 5.0) -> None:
    """Terminate live processes, wait up to ``grace_s`` in all, kill the rest."""
    procs = [p for p in procs if p.pid is not None]  # started ones
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def _read(out_dir: str, rank: int):
    path = Path(out_dir) / f"rank{rank}.pkl"
    if not path.exists():
        raise SpawnError(f"rank {rank} exited without a result", rank=rank)
    return pickle.loads(path.read_bytes())


def _blame(procs, out_dir: str, first: int, codes: list) -> SpawnError:
    """The rank killed by a signal before anyone was stopped (its peers' errors follow from it); else the
    first Python error; else ``first``, the rank seen dying first."""
    n, errors = len(procs), []
    killed = [r for r, c in enumerate(codes) if c is not None and c < 0]
    if killed:
        first = min(killed, key=lambda r: r != first)  # the one seen first if it is among them
        name = signal.Signals(-codes[first]).name
        hint = " (out of memory?)" if -codes[first] == signal.SIGKILL else ""
        return SpawnError(f"rank {first} of {n} was killed by {name}{hint}", rank=first, exitcode=codes[first])
    for r in range(n):
        path = Path(out_dir) / f"rank{r}.pkl"
        if path.exists():
            status, *rest = pickle.loads(path.read_bytes())
            if status == "error":
                errors.append((rest[1], r, rest[0]))
    if errors:
        _, r, tb = min(errors)
        last = tb.strip().splitlines()[-1]
        return SpawnError(f"rank {r} of {n} failed: {last}", rank=r, details=tb, exitcode=codes[r])
    code = codes[first]
    return SpawnError(f"rank {first} of {n} exited with code {code} without a Python error", rank=first,
                      exitcode=code)
