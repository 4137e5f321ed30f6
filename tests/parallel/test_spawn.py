"""``ndtrain.spawn.spawn``, the one helper that starts local ranks: results and environment per rank,
the failing rank named with its traceback, hung and dead ranks named, and no rank left running."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ndtrain.spawn import SpawnError, spawn
from tests.dist_utils import is_alive, live_descendants, run_ranks

ROOT = Path(__file__).resolve().parents[2]


def _report(rank: int, world: int, offset: int):
    import torch
    import torch.distributed as dist

    t = torch.tensor([rank + offset])
    dist.all_reduce(t)
    env = tuple(os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "OMP_NUM_THREADS", "EXTRA"))
    return rank, world, int(t), env, torch.get_num_threads()


def _rank1_raises(rank: int, world: int):
    import torch
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("rank one broke")
    dist.all_reduce(torch.ones(1))  # waits for rank 1 forever (collective timeout 600 s)


def _rank0_hangs(rank: int, world: int, pid_file: str):
    if rank == 0:
        with open(pid_file, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(600)
    return rank


def _sleep(rank: int, world: int):
    time.sleep(600)


def _rank1_dies(rank: int, world: int, how: str):
    if rank == 1:
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's out-of-memory killer would
    time.sleep(600)


def test_results_and_environment_per_rank():
    out = spawn(_report, 2, (5,), backend="gloo", threads=1, env={"EXTRA": "x"}, timeout_s=240)
    # all-reduce of rank + 5 over ranks 0, 1 = 11 on both
    assert out == [(0, 2, 11, ("0", "0", "2", "1", "x"), 1), (1, 2, 11, ("1", "1", "2", "1", "x"), 1)]


def test_failing_rank_is_named_with_its_traceback_and_the_others_stopped():
    t0 = time.monotonic()
    with pytest.raises(SpawnError) as info:
        spawn(_rank1_raises, 2, backend="gloo", threads=1, group_timeout_s=600, timeout_s=300)
    # rank 0 sat in a collective with a 600 s timeout: it was stopped, not waited for
    assert time.monotonic() - t0 < 150
    e = info.value
    assert str(e) == "rank 1 of 2 failed: ValueError: rank one broke" and e.rank == 1
    assert "Traceback" in e.details and "_rank1_raises" in e.details
    with pytest.raises(AssertionError, match=r"(?s)rank 1 of 2 failed: ValueError: rank one broke.*Traceback"):
        run_ranks(_rank1_raises, 2, timeout_s=300)


class _NotAnException(BaseException):
    """Like torch.distributed.checkpoint's CheckpointException: derives from BaseException only."""


def _rank0_raises_base_exception(rank: int, world: int):
    if rank == 0:
        raise _NotAnException("saved [512, 64] vs current [512, 128]")


def test_base_exception_in_a_rank_is_reported_with_its_traceback():
    with pytest.raises(SpawnError) as info:
        spawn(_rank0_raises_base_exception, 2, timeout_s=120)
    e = info.value
    assert e.rank == 0 and "_NotAnException: saved [512, 64] vs current [512, 128]" in str(e)
    assert "Traceback" in e.details and "without a Python error" not in str(e)


@pytest.mark.slow  # costly on 2 cores; the same axis keeps a smaller default test
def test_hung_rank_is_named_and_killed(tmp_path):
    pid_file = tmp_path / "pid"
    with pytest.raises(SpawnError, match=r"^rank\(s\) 0 of 2 did not finish within 20 s \(hung\?\)"):
        spawn(_rank0_hangs, 2, (str(pid_file),), timeout_s=20)
    with pytest.raises(ProcessLookupError):  # stopped and reaped
        os.kill(int(pid_file.read_text()), 0)


@pytest.mark.parametrize("how, message", [
    ("exit", r"^rank 1 of 2 exited with code 3 without a Python error$"),
    ("kill", r"^rank 1 of 2 was killed by SIGKILL \(out of memory\?\)$")])
def test_rank_dying_without_python_error(how, message):
    with pytest.raises(SpawnError, match=message):  # rank 0, asleep for 600 s, is stopped at once
        spawn(_rank1_dies, 2, (how,), timeout_s=240)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc")
def test_ranks_exit_when_the_launcher_is_killed():
    """SIGKILL leaves the launcher no chance to stop its ranks: their watchdog must."""
    code = "from ndtrain.spawn import spawn; from tests.parallel.test_spawn import _sleep; spawn(_sleep, 2)"
    launcher = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    ranks: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the 2 ranks (+ multiprocessing's resource tracker)
            ranks = live_descendants(launcher.pid)
            if len(ranks) >= 3:
                break
            time.sleep(0.2)
        assert len(ranks) >= 2, ranks
        time.sleep(1.0)
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 10  # the watchdog looks once a second
        while any(is_alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in ranks if is_alive(p)]
    finally:
        launcher.kill()
        for p in ranks:
            if is_alive(p):
                os.kill(p, signal.SIGKILL)
