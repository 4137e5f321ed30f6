"""Start the ranks of a run: N local processes, or the processes torchrun already started.

* ``--nproc N``: the parent validates the config for world size N, runs the pre-start checks
  (``ndtrain.cli.preflight``), prepares the data once (tokenizer training and token shards are cached),
  then starts N processes with ``spawn``; each calls ``init_process_group`` (gloo on CPU, NCCL with
  one GPU per process) and trains.
* Under ``torchrun`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` in the environment) the process joins
  torchrun's rendezvous; local rank 0 of each node prepares the data while the others wait.

Local ranks start through ``ndtrain.spawn.spawn`` (re-exported here), the one process-starting
helper of the package, tests and benchmarks.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ndtrain.cli.preflight import backend_for, preflight
from ndtrain.config import Config, ConfigError, validate
from ndtrain.mesh import device_for_rank
from ndtrain.spawn import SpawnError, free_port, policy_env, running_under, spawn, thread_policy

__all__ = ["SpawnError", "backend_for", "free_port", "launch", "prepare_checked", "spawn"]


def _group_timeout(cfg: Config) -> timedelta:
    """The process group's own timeout: longer than ``parallel.collective_timeout_s``, so the timed
    wait of ``ndtrain.parallel.comm`` fires first with an error naming rank, axis and op; it still
    bounds the collectives that bypass that wrapper. Never below torch's 30 min default, which
    covers a long first data preparation while the other ranks wait at a barrier."""
    return timedelta(seconds=max(1800.0, cfg.parallel.collective_timeout_s + 60.0))


def _train_rank(rank: int, world: int, cfg: Config, run_dir: str, data_path: str) -> None:
    from ndtrain.train.loop import run

    device = device_for_rank(rank, cfg.training.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group(backend_for(cfg), rank=rank, world_size=world, timeout=_group_timeout(cfg),
                                device_id=device if device.type == "cuda" else None)
    try:
        run(cfg, Path(run_dir), Path(data_path), device)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def prepare_checked(cfg: Config) -> Path:
    """``prepare_data`` with its errors turned into ConfigError (a cache that cannot be written:
    StorageError), and the splits checked to hold at least one sequence of ``data.seq_len`` (+1)
    tokens, so a bad data setup fails before training."""
    from ndtrain.data import prepare_data
    from ndtrain.data.chat import open_data, prepare_chat

    try:
        if cfg.data.sources:  # a mixture: every source prepared and checked (ndtrain.data.mixture)
            from ndtrain.data.mixture import prepare_mixture

            return prepare_mixture(cfg.data, cfg.model.vocab_size)
        path = (prepare_chat if cfg.data.format == "chat" else prepare_data)(cfg.data, cfg.model.vocab_size)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(f"data: {e}") from None
    except OSError as e:  # a full or read-only data.cache_dir: one line (StorageError), not a traceback
        from ndtrain.errors import StorageError
        from ndtrain.train.outputs import write_failure

        line = write_failure(e, cfg.data.cache_dir, "no step was trained")
        if line is None:
            raise
        raise StorageError(line) from None
    data, T = open_data(path), cfg.data.seq_len
    if cfg.eval.sets:  # tokenized (cached) before any rank starts; a bad source is one line here
        from ndtrain.data.eval_sets import prepare_eval_sets

        try:
            prepare_eval_sets(cfg, data.tokenizer)
        except (ValueError, FileNotFoundError) as e:
            raise ConfigError(str(e)) from None
    for split in ("train", "val"):
        if data.num_sequences(split, T) < 1:
            raise ConfigError(f"data: the {split} split has {data.num_tokens(split)} tokens, fewer than "
                              f"one sequence of data.seq_len + 1 ({T + 1}); use a larger corpus, a "
                              f"shorter seq_len or a larger data.val_fraction")
    return path


def _announce(on: bool, run_dir: Path, cfg: Config | None = None) -> None:
    """Print the run directory and a note per setting that has no effect in this layout."""
    if not on:
        return
    print(f"run dir: {run_dir}", flush=True)
    if cfg is not None:
        from ndtrain.parallel.pp.rules import inert_settings

        p = cfg.parallel
        for note in inert_settings(p.pp, p.pp_schedule, p.pp_virtual_stages, p.pp_layout):
            print(f"note: {note}", flush=True)
        from ndtrain.hf.rules import export_note

        if note := export_note(cfg.model):  # before training, not after it
            print(f"note: {note}", flush=True)


def _already_finished(cfg: Config, run_dir: Path, announce: bool) -> bool:
    """True (and one line, printed if ``announce``) when the run directory's newest checkpoint
    already reached this job's end (``ndtrain.run_dir.finished_message``): no process starts."""
    from ndtrain.cli.rerun import finished_message

    msg = finished_message(cfg, Path(run_dir))
    if msg and announce:
        print(msg, flush=True)
    return msg is not None


def launch(cfg: Config, run_dir: Path, nproc: int | None = None, announce: bool = False,
           max_restarts: int = 0, elastic: bool = False) -> None:
    """Train ``cfg`` with ``nproc`` local ranks (or under torchrun when ``nproc`` is None);
    ``announce`` prints the run directory once the checks passed; ``max_restarts`` restarts all
    local ranks after one dies (``ndtrain.fault.supervisor``; torchrun has its own flag);
    ``elastic`` continues on the surviving ranks when one is lost (``ndtrain.fault.elastic``).

    Returns at once, starting nothing, when the run directory already reached this job's end
    (one line; ``ndtrain.cli.rerun``). The run directory is locked for the whole call
    (``ndtrain.cli.lock``; under torchrun by global rank 0). Raises ConfigError (before any rank
    starts) for an invalid layout, an unusable run directory, backend, checkpoint path or data, a
    checkpoint past ``training.steps``, a model / data change against the run directory's
    checkpoints or an ``init_weights_from`` checkpoint of another shape (``ndtrain.cli.preflight``);
    RunDirInUse (a ConfigError) when another training holds the run directory; SpawnError when a
    local rank fails.
    """
    under_torchrun = nproc is None and "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if under_torchrun:
        world = int(os.environ["WORLD_SIZE"])
        if max_restarts:
            raise ConfigError("--max-restarts restarts local ranks; under torchrun use torchrun's --max-restarts")
        if elastic:  # torchrun restarted the workers at another world size: the planner's layout
            from ndtrain.fault.elastic import replan_for_world

            cfg = replan_for_world(cfg, world, Path(run_dir), int(os.environ["RANK"]))
    else:
        world = 1 if nproc is None else nproc
        if world < 1:
            raise ConfigError(f"--nproc ({world}) must be >= 1")
        if max_restarts < 0:
            raise ConfigError(f"--max-restarts ({max_restarts}) must be >= 0")
        if elastic and not max_restarts:  # (under torchrun, torchrun's own restarts; see above)
            raise ConfigError("--elastic continues after a lost rank by restarting: give --max-restarts K (K >= 1)")
    validate(cfg, world)
    preflight(cfg, Path(run_dir), world)
    # data errors are one line before the run directory is announced or locked (torchrun: per node)
    data_path = None if under_torchrun else prepare_checked(cfg)
    lock = _lock(Path(run_dir), under_torchrun)
    try:
        if _already_finished(cfg, run_dir, announce):
            return
        _announce(announce, run_dir, cfg)
        if under_torchrun:
            _join_torchrun(cfg, Path(run_dir), world)
        else:
            _run_local(cfg, Path(run_dir), world, max_restarts, elastic, data_path)
    finally:
        if lock is not None:
            lock.release()


def _lock(run_dir: Path, under_torchrun: bool):
    """The run directory's lock (``ndtrain.cli.lock``), taken by the launching process, or by global
    rank 0 under torchrun (None on the other ranks); prints a line when a stale lock is taken over."""
    from ndtrain.cli.lock import RunDirLock

    if under_torchrun and os.environ.get("RANK", "0") != "0":
        return None
    lock = RunDirLock(run_dir)
    note = lock.acquire()
    if note:
        print(note, flush=True)
        from ndtrain.events import log_event

        log_event(run_dir, "lock_taken_over", pid=lock.taken_over_pid)
    return lock


def _join_torchrun(cfg: Config, run_dir: Path, world: int) -> None:
    """This process is one of torchrun's ranks: join its group, prepare data, train."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = device_for_rank(local_rank, cfg.training.device)
    if world > 1:
        dist.init_process_group(backend_for(cfg), timeout=_group_timeout(cfg),
                                device_id=device if device.type == "cuda" else None)
    # Local rank 0 of each node prepares the cache; the rest wait at the barrier, then reuse it.
    if local_rank == 0:
        data_path = prepare_checked(cfg)
    if world > 1:
        dist.barrier()
    if local_rank != 0:
        data_path = prepare_checked(cfg)
    from ndtrain.fault.supervisor import note_torchrun_restart
    from ndtrain.train.loop import run

    note_torchrun_restart(run_dir, dist.get_rank() if world > 1 else 0)
    policy = thread_policy(int(os.environ.get("LOCAL_WORLD_SIZE", "") or 1))  # torchrun's OMP_NUM_THREADS caps
    try:
        with _sigterm_as_interrupt(os.environ.get("RANK", "0") == "0"), running_under(policy):
            run(cfg, run_dir, data_path, device)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run_local(cfg: Config, run_dir: Path, nproc: int, max_restarts: int, elastic: bool = False,
               data_path: Path | None = None) -> None:
    """``nproc`` local ranks (this process alone for one rank without restarts); ``elastic``: after a
    rank is lost for good, go on with the survivors (``ndtrain.fault.elastic.Elastic``); ``data_path``:
    the prepared data (None: prepared here)."""
    data_path = data_path if data_path is not None else prepare_checked(cfg)
    policy = thread_policy(nproc)  # the same rule as torchrun's workers (``ndtrain.spawn.thread_policy``)
    if nproc == 1 and not max_restarts:
        from ndtrain.train.loop import run

        with _sigterm_as_interrupt(True), running_under(policy):
            run(cfg, run_dir, data_path)
        return
    from ndtrain.fault.elastic import Elastic
    from ndtrain.fault.supervisor import supervise
    from ndtrain.train.outputs import refresh_plot

    def attempt(c: Config, n: int):
        p = policy if n == nproc else thread_policy(n)  # an elastic restart on fewer ranks: more each
        return spawn(_train_rank, n, (c, str(run_dir), str(data_path)), threads=p.threads, env=policy_env(p))

    el = Elastic(cfg, nproc, Path(run_dir), attempt) if elastic else None
    try:
        supervise(el.start if el else lambda: attempt(cfg, nproc), max_restarts, Path(run_dir),
                  on_failure=el.after_failure if el else None)
    except (KeyboardInterrupt, SpawnError):  # the ranks are stopped: the launcher draws their curve
        refresh_plot(run_dir, cfg.logging.plot, safe=True)
        raise


@contextlib.contextmanager
def _sigterm_as_interrupt(on: bool):
    """While training in this process: SIGTERM (``kill``, a scheduler's stop, torchrun stopping its
    workers) unwinds like Ctrl-C, so the loop writes ``loss.png`` on the way out."""
    if not on or threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(_signum, _frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
