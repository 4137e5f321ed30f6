"""Spawn gloo ranks for a test through the package's one helper (``ndtrain.spawn.spawn``: free port,
per-rank results, the failing rank's traceback, timeouts), with assertion errors for pytest."""
from __future__ import annotations

from pathlib import Path

from ndtrain.spawn import SpawnError, spawn


def run_ranks(fn, world: int, *args, timeout_s: float = 300.0) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo processes (one thread each); return the
    per-rank results.

    ``fn`` must be importable (module level). A failing rank raises AssertionError carrying its
    traceback; a hang past ``timeout_s`` kills the ranks and fails, naming the ranks still running.
    """
    try:
        return spawn(fn, world, args, backend="gloo", threads=1, timeout_s=timeout_s, group_timeout_s=120.0)
    except SpawnError as e:
        raise AssertionError(f"{e}\n{e.details}" if e.details else str(e)) from None


def live_descendants(pid: int) -> set[int]:
    """Pids of the live descendants of ``pid``, from /proc (Linux; zombies count as gone)."""
    parents = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                parents[int(d.name)] = int(fields[1])
    out, frontier = set(), {pid}
    while frontier:
        frontier = {c for c, p in parents.items() if p in frontier} - out
        out |= frontier
    return out


def is_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
