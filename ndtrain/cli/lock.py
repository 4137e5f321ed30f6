"""One training at a time per run directory: ``RUN_DIR/ndtrain.lock``.

Two trainings into one directory would both append every metrics row to ``metrics.jsonl`` and race
on its checkpoints. The launcher (``ndtrain.cli.launch``) therefore takes the lock before any rank
starts, after the pre-start checks: the ``ndtrain train`` process itself with ``--nproc`` (its ranks
and restarts run under it), or under torchrun the process of global rank 0. It is released when that
process leaves ``launch``, however it leaves.

The lock is an exclusive ``flock`` on the file, which the kernel drops when its holder dies in any
way (``kill -9`` included); the file holds the holder's pid and host for the message. A second
launch fails before anything starts with ``RunDirInUse``: "run dir runs/x in use by pid N". A file
left behind by a holder that died is taken over, and the launcher prints one line saying so. Where
the file system has no ``flock`` (some network mounts answer ENOLCK), the recorded pid is checked
instead: alive on this host (same process start time) means in use.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
from pathlib import Path

from ndtrain.errors import ConfigError

LOCK_NAME = "ndtrain.lock"


class RunDirInUse(ConfigError):
    """Another live process holds the run directory's lock; the message names its pid."""


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22), which
    tells a live holder from an unrelated process that got its pid later; None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(holder: dict) -> bool:
    """Whether the process named by a lock file's content still runs (on this host)."""
    pid = holder.get("pid")
    if not isinstance(pid, int):
        return False
    if holder.get("host") != socket.gethostname():
        return True  # another host's process: it cannot be checked from here, so it counts as live
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    start = holder.get("start")
    return start is None or _start_time(pid) in (None, start)


class RunDirLock:
    """``acquire()`` / ``release()`` the lock of ``run_dir``."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._fd: int | None = None
        self.taken_over_pid: int | None = None  # set by acquire when it took over a stale lock

    def acquire(self) -> str | None:
        """Take the lock (creating the run directory); returns a one-line note when a lock left
        by a process that no longer runs was taken over, else None.

        Raises:
            RunDirInUse: a live process holds it.
        """
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for _ in range(5):  # the holder may release (remove the file) between our open and flock
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                note = self._take(fd)
            except BaseException:
                os.close(fd)
                raise
            if note != "retry":
                self._fd = fd
                return note
            os.close(fd)
        raise RunDirInUse(f"run dir {self.run_dir}: could not take {self.path} (it keeps changing)")

    def _take(self, fd: int) -> str | None:
        held_by_flock = True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirInUse(self._in_use(_read(fd))) from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            held_by_flock = False
        try:
            if os.fstat(fd).st_ino != os.stat(self.path).st_ino:
                return "retry"  # we locked a file its holder had just removed
        except FileNotFoundError:
            return "retry"
        old = _read(fd)
        if old and not held_by_flock and _alive(old):
            raise RunDirInUse(self._in_use(old))
        me = {"pid": os.getpid(), "host": socket.gethostname(), "start": _start_time(os.getpid())}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        if old and old.get("pid") is not None:
            self.taken_over_pid = old.get("pid")
            return (f"note: run dir {self.run_dir}: its lock was left by pid {old.get('pid')}, which "
                    "no longer runs; taken over")
        return None

    def _in_use(self, holder: dict) -> str:
        pid = holder.get("pid", "?")
        host = holder.get("host")
        where = f" on {host}" if host and host != socket.gethostname() else ""
        return (f"run dir {self.run_dir} in use by pid {pid}{where}; wait for that training to end, "
                f"stop it, or pass another --run-dir")

    def release(self) -> None:
        """Remove the file and drop the lock (idempotent)."""
        if self._fd is None:
            return
        try:
            if os.fstat(self._fd).st_ino == os.stat(self.path).st_ino:
                self.path.unlink()
        except OSError:
            pass  # already gone, or the directory was removed: nothing left to release but the fd
        os.close(self._fd)
        self._fd = None


def _read(fd: int) -> dict:
    """The lock file's content ({} when empty or unreadable: a holder that died while writing)."""
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
