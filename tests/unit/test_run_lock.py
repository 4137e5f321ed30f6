"""One training per run directory (``ndtrain.cli.lock``): a second launch into a held run directory
fails before anything starts with one line naming the holder's pid (exit 2); a lock left by a
process that died is taken over with a line saying so; the launcher releases it however it ends."""
from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ndtrain.cli import lock as lockmod
from ndtrain.cli.launch import launch
from ndtrain.cli.lock import LOCK_NAME, RunDirInUse, RunDirLock
from ndtrain.config import ConfigError, load_config
from ndtrain.events import read_events

ROOT = Path(__file__).resolve().parents[2]
HOLD = ("import sys, time; from ndtrain.cli.lock import RunDirLock; RunDirLock(sys.argv[1]).acquire(); "
        "print('held', flush=True); time.sleep(120)")


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    return int(proc.stdout)


def test_second_launch_into_a_held_run_dir_is_one_line_exit_2(tmp_path):
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True,
                              cwd=ROOT)
    try:
        assert holder.stdout.readline() == "held\n"
        proc = subprocess.run([sys.executable, "-m", "ndtrain.cli.commands", "train", "--config", "debug",
                               "--nproc", "1", f"--run-dir={run}"], check=False, capture_output=True, text=True,
                              timeout=120, cwd=ROOT)
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [
        (f"ndtrain: run dir {run} in use by pid {holder.pid}; wait for that training to end, stop it, "
         "or pass another --run-dir")]
    assert not (run / "config.yaml").exists()  # nothing of the second run was written


def test_lock_of_a_killed_holder_is_free_and_taken_over(tmp_path):
    """``kill -9`` leaves the file; the kernel dropped the flock, so the next launch takes it."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE,
                              text=True, cwd=ROOT)
    assert holder.stdout.readline() == "held\n"
    with pytest.raises(RunDirInUse, match=rf"in use by pid {holder.pid};"):
        RunDirLock(tmp_path).acquire()
    holder.kill()
    holder.wait()
    lock = RunDirLock(tmp_path)
    note = lock.acquire()
    assert note == (f"note: run dir {tmp_path}: its lock was left by pid {holder.pid}, which no longer "
                    "runs; taken over")
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == lockmod.os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_same_process_twice_is_refused_and_release_is_idempotent(tmp_path):
    first = RunDirLock(tmp_path)
    assert first.acquire() is None
    with pytest.raises(RunDirInUse, match=rf"run dir {tmp_path} in use by pid {lockmod.os.getpid()};"):
        RunDirLock(tmp_path).acquire()
    first.release()
    first.release()
    again = RunDirLock(tmp_path)
    assert again.acquire() is None and (tmp_path / LOCK_NAME).is_file()
    again.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_without_flock_the_recorded_pid_decides(tmp_path, monkeypatch):
    """A file system without flock (ENOLCK): a live pid on this host holds it, a dead one not."""
    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lockmod.fcntl, "flock", no_flock)
    me = lockmod.os.getpid()
    host = lockmod.socket.gethostname()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": me, "host": host, "start": lockmod._start_time(me)}))
    with pytest.raises(RunDirInUse, match=rf"in use by pid {me};"):
        RunDirLock(tmp_path).acquire()
    reused = {"pid": me, "host": host, "start": "1"}  # our pid, but another process's start time
    (tmp_path / LOCK_NAME).write_text(json.dumps(reused))
    lock = RunDirLock(tmp_path)
    assert "left by pid" in lock.acquire()
    lock.release()
    dead = _dead_pid()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": dead, "host": host}))
    lock = RunDirLock(tmp_path)
    assert lock.acquire() == f"note: run dir {tmp_path}: its lock was left by pid {dead}, which no longer runs; taken over"
    lock.release()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": dead, "host": "elsewhere"}))
    with pytest.raises(RunDirInUse, match=rf"in use by pid {dead} on elsewhere;"):
        RunDirLock(tmp_path).acquire()  # another host's process cannot be checked: it counts as live


def test_launch_releases_the_lock_on_every_exit(tmp_path, capsys, monkeypatch):
    """Taken after the pre-start checks and the data preparation (a rejected layout or a missing
    corpus leaves no directory and no lock), released when the launch returns early (already
    finished) or fails after taking it; a stale one is announced and logged."""
    from ndtrain.cli import launch as launchmod

    with pytest.raises(ConfigError):
        launch(load_config("debug", {"parallel.tp": 3}), tmp_path / "bad", 2)
    assert not (tmp_path / "bad").exists()
    cfg = load_config("debug", {"data.source": str(tmp_path / "missing-*.txt"),
                                "data.cache_dir": str(tmp_path / "cache")})
    with pytest.raises(ConfigError, match="data: "):  # before the lock: nothing made
        launch(cfg, tmp_path / "nodata", 1)
    assert not (tmp_path / "nodata").exists()
    run = tmp_path / "run"
    run.mkdir()
    dead = _dead_pid()
    (run / LOCK_NAME).write_text(json.dumps({"pid": dead, "host": lockmod.socket.gethostname()}))

    def crash(*args, **kwargs):
        raise RuntimeError("rank 0 failed")

    monkeypatch.setattr(launchmod, "_run_local", crash)
    with pytest.raises(RuntimeError, match="rank 0 failed"):  # fails after the lock was taken
        launch(load_config("debug", {"data.cache_dir": str(tmp_path / "cache")}), run, 1)
    assert capsys.readouterr().out.splitlines()[0] == (
        f"note: run dir {run}: its lock was left by pid {dead}, which no longer runs; taken over")
    assert [e["pid"] for e in read_events(run, "lock_taken_over")] == [dead]
    assert not (run / LOCK_NAME).exists()


def test_under_torchrun_only_global_rank_0_takes_it(tmp_path, monkeypatch):
    from ndtrain.cli.launch import _lock

    monkeypatch.setenv("RANK", "1")
    assert _lock(tmp_path, under_torchrun=True) is None and not (tmp_path / LOCK_NAME).exists()
    monkeypatch.setenv("RANK", "0")
    held = _lock(tmp_path, under_torchrun=True)
    with pytest.raises(RunDirInUse):
        _lock(tmp_path, under_torchrun=False)  # the same directory from a local launch
    held.release()


def test_sigterm_unwinds_like_ctrl_c_while_training_in_process():
    """So the loop's interrupt path (loss.png) also runs under ``kill`` or torchrun's stop."""
    import signal

    from ndtrain.cli.launch import _sigterm_as_interrupt

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt), _sigterm_as_interrupt(True):
        lockmod.os.kill(lockmod.os.getpid(), signal.SIGTERM)
        signal.pause()  # not reached: the handler raises as soon as the signal arrives
    assert signal.getsignal(signal.SIGTERM) is before
    with _sigterm_as_interrupt(False):
        assert signal.getsignal(signal.SIGTERM) is before
