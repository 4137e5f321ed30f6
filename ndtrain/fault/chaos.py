"""A chaos driver for supervised runs: start ``ndtrain train --max-restarts K`` and ``kill -9`` its
ranks at seeded random moments, at least once while a checkpoint is being written; with ``lose``,
some kills first mark the rank lost for good (``ndtrain.fault.elastic.mark_lost``), so an
``--elastic`` run continues without it.

Used by the chaos test (``tests/integration/test_fault_tolerance.py``) and ``bench/chaos.py``. Linux
only (ranks are found in ``/proc`` as the launcher's ``multiprocessing`` children).
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

_POLL_S = 0.002  # a tiny model's save lasts ~0.1 s: poll often enough to land inside one


@dataclass
class ChaosResult:
    """What happened: ``returncode`` of the launcher, ``wall_s``, ``kills`` (one dict per kill:
    ``kind`` random | save | lose, ``rank``, ``pid``, ``during_save`` (a ``.tmp`` checkpoint folder existed
    right after the kill), ``at_s`` since start) and the launcher's ``output``."""

    returncode: int
    wall_s: float
    kills: list[dict] = field(default_factory=list)
    output: str = ""


def _children(pid: int) -> dict[int, str]:
    """Live direct and indirect children of ``pid`` with their command lines."""
    parents, cmd = {}, {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            line = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if fields[0] != "Z":
            parents[int(d.name)], cmd[int(d.name)] = int(fields[1]), line
    out, frontier = {}, {pid}
    while frontier:
        frontier = {c for c, p in parents.items() if p in frontier} - set(out)
        out.update({c: cmd[c] for c in frontier})
    return out


def rank_pids(launcher_pid: int) -> dict[int, int]:
    """{rank: pid} of the launcher's live rank processes (``multiprocessing`` spawn children, not
    its resource tracker; the rank read from the ``RANK`` of their environment)."""
    out = {}
    for pid, line in _children(launcher_pid).items():
        if "spawn_main" not in line or "resource_tracker" in line:
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
        if rank is not None:
            out[rank] = pid
    return out


def _max_step(run_dir: Path, since: float = 0.0) -> int:
    """The newest step in ``metrics.jsonl`` (-1 when none, or the file was not written after
    ``since``, a ``time.time()``)."""
    path = run_dir / "metrics.jsonl"
    best = -1
    try:
        if path.stat().st_mtime < since:
            return best
        lines = path.read_text().splitlines()
    except OSError:
        return best
    for line in lines:
        try:
            best = max(best, int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):
            continue
    return best


def latest_step(ckpt_root: Path) -> int:
    """Step of the newest complete ``step_XXXXXXXX`` folder (0 when none)."""
    try:
        steps = [int(p.name[5:]) for p in ckpt_root.iterdir() if p.name[5:].isdigit() and p.name.startswith("step_")]
    except OSError:
        return 0
    return max(steps, default=0)


def _tmp_ids(ckpt_root: Path) -> set[tuple[str, int]]:
    """(name, inode) of each ``step_*.tmp`` folder: a save in progress, or one a kill left behind
    (same name, other inode once the next save recreated it)."""
    out = set()
    try:
        for p in ckpt_root.iterdir():
            if p.name.startswith("step_") and p.name.endswith(".tmp"):
                out.add((p.name, p.stat().st_ino))
    except OSError:
        pass
    return out


def _wait_for(cond, proc, deadline: float, poll_s: float = 0.05) -> bool:
    while time.monotonic() < deadline and proc.poll() is None:
        if cond():
            return True
        time.sleep(poll_s)
    return False


def chaos_run(cmd: list[str], run_dir: Path, nproc: int, kills: int, seed: int, *, save_kills: int = 1,
              max_delay_s: float = 1.0, timeout_s: float = 600.0, env: dict | None = None,
              after_checkpoint: bool = True, lose: int = 0) -> ChaosResult:
    """Run ``cmd`` (an ``ndtrain train --nproc NPROC --max-restarts K --run-dir RUN_DIR`` command)
    and kill one random rank ``kills`` times with SIGKILL. ``save_kills`` of them (chosen at random
    positions) wait for a ``.tmp`` checkpoint folder and kill at once; a save kill that missed the
    save (the folder was already renamed) is retried at the next chance, up to 3 times. The others
    wait until the attempt made progress (``after_checkpoint``: completed a new checkpoint, so every
    attempt moves the run on; else: trained a step), then ``uniform(0, max_delay_s)`` seconds.
    ``lose`` of the other kills (the first ones) write the rank's lost marker right before the
    kill; the attempts after it have one rank fewer. Returns after the launcher exits (killed,
    with its process group, after ``timeout_s``)."""
    rng = random.Random(seed)
    kinds = ["random"] * kills
    for i in rng.sample(range(kills), min(save_kills, kills)):
        kinds[i] = "save"
    for i in [i for i, k in enumerate(kinds) if k == "random"][:lose]:
        kinds[i] = "lose"
    run_dir, t0 = Path(run_dir), time.monotonic()
    deadline = t0 + timeout_s
    log_path = run_dir.with_name(run_dir.name + ".chaos.log")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    result = ChaosResult(returncode=-1, wall_s=0.0)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, **(env or {})))
        try:
            _kill_loop(proc, run_dir, nproc, kinds, rng, max_delay_s, deadline, result, t0, after_checkpoint)
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # this driver's own session: launcher and ranks
                proc.wait()
    result.returncode, result.wall_s = proc.returncode, time.monotonic() - t0
    result.output = log_path.read_text()
    return result


def _kill_loop(proc, run_dir, nproc, kinds, rng, max_delay_s, deadline, result, t0, after_checkpoint) -> None:
    ckpt_root, seen = run_dir / "checkpoints", set()
    save_misses = 0
    while kinds and proc.poll() is None and time.monotonic() < deadline:
        # a fresh attempt: all its ranks up (none of the pids killed or seen before)
        if not _wait_for(lambda n=nproc: len(set(rank_pids(proc.pid).values()) - seen) >= n, proc, deadline):
            return
        pids, up_at = rank_pids(proc.pid), time.time()
        seen.update(pids.values())
        resume = latest_step(ckpt_root)
        kind = kinds[0]
        if kind == "save":
            stale = _tmp_ids(ckpt_root)
            ok = _wait_for(lambda stale=stale: bool(_tmp_ids(ckpt_root) - stale), proc, deadline, _POLL_S)
            saving = _tmp_ids(ckpt_root) - stale
        else:
            # this attempt made progress: a new complete checkpoint (or, without checkpoints, a step)
            progressed = ((lambda r=resume: latest_step(ckpt_root) > r) if after_checkpoint
                          else (lambda r=resume, t=up_at: _max_step(run_dir, t) > r))
            ok = _wait_for(progressed, proc, deadline, 0.02)
            time.sleep(rng.uniform(0.0, max_delay_s))
        if not ok or proc.poll() is not None:
            return
        rank = rng.choice(sorted(pids))
        if kind == "lose":
            from ndtrain.fault.elastic import mark_lost

            mark_lost(run_dir, rank)  # before the kill: the launcher reads it when the attempt fails
        try:
            os.kill(pids[rank], signal.SIGKILL)
        except ProcessLookupError:
            continue  # it ended by itself in the meantime: try again in the next attempt
        nproc -= kind == "lose"  # the next attempts run without it
        during = kind == "save" and bool(saving & _tmp_ids(ckpt_root))
        result.kills.append({"kind": kind, "rank": rank, "pid": pids[rank], "during_save": during,
                             "at_s": round(time.monotonic() - t0, 3)})
        if kind == "save" and not during and save_misses < 3:
            save_misses += 1
            continue  # a save kill that missed: the next kill waits for a save again
        kinds.pop(0)
