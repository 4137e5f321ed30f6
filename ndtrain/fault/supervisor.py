"""Supervised restarts: when any rank dies, stop them all and start them again from the newest
complete checkpoint, up to ``--max-restarts`` times.

The local launcher (``ndtrain train --nproc N --max-restarts K``) runs each attempt through
``ndtrain.spawn.spawn``, which already stops every rank as soon as one fails (a Python exception, a
non-zero exit, a signal such as ``kill -9`` or the out-of-memory killer, or a hang past its
timeout) and names the rank to blame. ``supervise`` then logs a ``restart`` event and starts a
fresh attempt; the ranks resume with ``checkpoint.resume`` from the newest checkpoint that verifies
(``ndtrain.checkpoint.dcp.usable_checkpoint``), so a failure costs the steps since that checkpoint plus
one start-up. Under torchrun, torchrun's own ``--max-restarts`` restarts the workers; they see
``TORCHELASTIC_RESTART_COUNT > 0`` and ``note_torchrun_restart`` logs the event.

Never retried: ``ConfigError`` (also raised before any rank starts), ``CheckpointUnusableError``
(checkpoints exist but none verifies) and ``StorageError`` (a write failed: a full disk), which
fail the same way every time.

With ``--elastic`` (``ndtrain.fault.elastic``) a rank that does not come back (marked lost, or
blamed twice in a row) is left out: the next attempt runs the survivors in the planner's layout.

This is the restart-from-checkpoint recovery of large runs (Llama 3, Dubey et al. 2024, section
3.3.4: 419 unexpected interruptions in 54 days, recovered by automated restarts) and of
TorchElastic; it does not replace a rank in place.
"""
from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

from ndtrain.events import log_event
from ndtrain.fault.goodput import mark_attempt
from ndtrain.spawn import SpawnError

NEVER_RETRY = ("ConfigError", "CheckpointUnusableError", "CheckpointDamagedError", "StorageError")


def retryable(error: SpawnError) -> bool:
    """False when the failing rank's exception is one of ``NEVER_RETRY`` (deterministic setup
    errors a restart would repeat)."""
    last = error.details.strip().splitlines()[-1] if error.details.strip() else ""
    exc_name = last.split(":", 1)[0].rsplit(".", 1)[-1]
    return exc_name not in NEVER_RETRY


def _checkpoint_step(run_dir: Path) -> int:
    """Step of the newest complete checkpoint folder (0 when none): where the next attempt resumes,
    unless that checkpoint fails verification (then a ``checkpoint_corrupt`` event follows)."""
    from ndtrain.checkpoint.dcp import latest_checkpoint  # imports torch: only once a rank failed

    path = latest_checkpoint(Path(run_dir) / "checkpoints")
    return int(path.name[5:]) if path else 0


def _last_logged_step(run_dir: Path) -> int | None:
    """The newest step in ``metrics.jsonl`` (how far the failed attempt got, to ``log_every``)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return None
    import json

    steps = []
    for line in path.read_text().splitlines():
        try:
            steps.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):
            continue  # a line torn by the kill
    return max(steps) if steps else None


def restart_event(run_dir: Path, error: SpawnError, attempt: int, max_restarts: int) -> dict:
    """Log (and return) the ``restart`` event of ``error``: ``rank`` (to blame; None when several
    hung), ``step`` (resume checkpoint step), ``last_step`` (newest logged step), ``steps_lost``,
    ``reason`` (the launcher's one line), ``exit_code`` / ``signal``, ``exception`` (the rank's
    last traceback line), ``attempt`` (1 = first restart) and ``max_restarts``."""
    step, last = _checkpoint_step(run_dir), _last_logged_step(run_dir)
    code = error.exitcode
    sig = signal.Signals(-code).name if code is not None and code < 0 else None
    exception = error.details.strip().splitlines()[-1] if error.details.strip() else None
    return log_event(run_dir, "restart", rank=error.rank, step=step, last_step=last,
                     steps_lost=None if last is None else max(0, last - step), reason=str(error),
                     exit_code=code, signal=sig, exception=exception, attempt=attempt,
                     max_restarts=max_restarts)


def supervise(start: Callable[[], object], max_restarts: int, run_dir: Path,
              say: Callable[[str], None] = print, on_failure: Callable | None = None) -> int:
    """Call ``start()`` (one attempt: start every rank, return when all finished) until it succeeds;
    after a retryable ``SpawnError`` log a ``restart`` event, say one line and start again, at most
    ``max_restarts`` times. ``on_failure(rank, step, last_step)`` runs before each restart (the
    elastic policy: ``ndtrain.fault.elastic.Elastic.after_failure`` may shrink the world there).
    When it gives up, a ``failed`` event (``reason``, ``rank``, ``restarts``, ``retryable``)
    records why. Returns the number of restarts used.

    Raises:
        SpawnError: the last attempt's failure, a failure that is never retried, or (elastic) one
            after which no layout of the surviving ranks validates (the message says so).
    """
    for attempt in range(max_restarts + 1):
        try:
            mark_attempt(attempt)  # the ranks' goodput accounting: which attempt, since when
            start()
            return attempt
        except SpawnError as e:
            if attempt == max_restarts or not retryable(e):
                log_event(run_dir, "failed", reason=str(e), rank=e.rank, restarts=attempt, retryable=retryable(e))
                raise
            ev = restart_event(Path(run_dir), e, attempt + 1, max_restarts)
            say(f"ndtrain: {e}; restart {attempt + 1} of {max_restarts} from step {ev['step']}")
            if on_failure is not None:
                _shrink(on_failure, e, ev, run_dir, attempt)
    raise AssertionError("unreachable")


def _shrink(on_failure: Callable, error: SpawnError, ev: dict, run_dir: Path, attempt: int) -> None:
    from ndtrain.errors import ConfigError

    try:
        on_failure(error.rank, ev["step"], ev["last_step"])
    except ConfigError as c:  # no survivors, or no layout of them validates: the job ends here
        log_event(run_dir, "failed", reason=str(c), rank=error.rank, restarts=attempt, retryable=False)
        raise SpawnError(f"{error}; {c}", error.rank, error.details, error.exitcode) from None


def note_torchrun_restart(run_dir: Path, rank: int) -> dict | None:
    """Under torchrun: log a ``restart`` event (rank 0 only) when torchrun restarted the workers
    (``TORCHELASTIC_RESTART_COUNT`` > 0). Which worker failed is in torchrun's own log; the event
    has ``rank`` None. Returns the event, or None when this is the first attempt or rank != 0."""
    count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if count <= 0 or rank != 0:
        return None
    limit = os.environ.get("TORCHELASTIC_MAX_RESTARTS")
    return log_event(run_dir, "restart", rank=None, step=_checkpoint_step(Path(run_dir)),
                     last_step=_last_logged_step(Path(run_dir)), reason="torchrun restarted the workers "
                     f"(TORCHELASTIC_RESTART_COUNT={count})", attempt=count,
                     max_restarts=int(limit) if limit and limit.isdigit() else None, launcher="torchrun")
