"""Goodput: where a job's wall time went.

A job is one ``ndtrain train`` invocation with all its supervised restarts (and elastic
continuations). Its wall time, from the launcher's start (``mark_job_start``) to the end of the
last attempt, is split into:

* ``steps``: optimizer steps that moved the run past the newest step any earlier attempt (or the
  same attempt before a rollback) had reached, data loading included -- the productive time;
* ``recomputed``: steps redone after a restart or a rollback (their step number had been reached
  before, and that work was thrown away);
* ``startup``: the first attempt's set-up until its first step (launcher checks, data preparation,
  process start, model build), less the two below;
* ``eval``: validation losses; ``checkpoint_save`` (the time the loop was blocked), ``checkpoint_load``;
* ``restarts``: everything the attempts did not account for -- the start-up of every later attempt,
  the time a killed attempt spent after its last report (lost), detection and relaunch;
* ``other``: the rest inside attempts (logging, text samples, plots).

goodput = steps / wall. Each attempt's rank 0 keeps a ``Goodput`` and appends a ``goodput`` event
(its cumulative accounting; ``job``, ``attempt``) to ``events.jsonl`` after every checkpoint and
at its end, so a killed attempt's accounting survives to its last checkpoint. The attempt that
ends the job combines every attempt's last event into the ``final`` one and prints
``summary_line`` (``goodput 93.1%: ...``).

``ndtrain train`` (``job_clock``) and the supervisor (``mark_attempt``) pass ``NDTRAIN_JOB_T0`` (job
start, Unix seconds), ``NDTRAIN_ATTEMPT`` and ``NDTRAIN_ATTEMPT_T0`` to the ranks in their
environment; without them (``ndtrain.train.loop.run`` called directly) the job is the attempt, from
the moment ``Goodput`` is created. Under torchrun each worker restart is its own job.
"""
from __future__ import annotations

import contextlib
import os
import time
from collections import defaultdict
from pathlib import Path

from ndtrain.events import log_event, read_events
from ndtrain.spawn import environ

CATEGORIES = ("steps", "recomputed", "startup", "eval", "checkpoint_save", "checkpoint_load", "restarts", "other")
_ENV_JOB, _ENV_ATTEMPT, _ENV_ATTEMPT_T0 = "NDTRAIN_JOB_T0", "NDTRAIN_ATTEMPT", "NDTRAIN_ATTEMPT_T0"


@contextlib.contextmanager
def job_clock():
    """``ndtrain train``, around everything: the job (and its ranks, which inherit the
    environment) starts now, attempt 0; the variables are restored afterwards."""
    now = repr(time.time())
    with environ({_ENV_JOB: now, _ENV_ATTEMPT: "0", _ENV_ATTEMPT_T0: now}):
        yield


def mark_attempt(attempt: int) -> None:
    """The supervisor, before starting attempt ``attempt`` inside ``job_clock``. The first attempt
    keeps the job's start (the launcher's checks and data preparation are its start-up); a later
    one starts now."""
    if _ENV_JOB in os.environ:
        os.environ[_ENV_ATTEMPT] = str(attempt)
        os.environ[_ENV_ATTEMPT_T0] = os.environ[_ENV_JOB] if attempt == 0 else repr(time.time())


class Goodput:
    """One attempt's accounting on one rank (only rank 0 writes events and prints).

    Call order: ``phase("checkpoint_load" | "eval" | "checkpoint_save")`` around those phases
    (``with``), ``begin_steps()`` when the step loop starts, ``step(n, seconds)`` after each step,
    ``redo(at_step, rollback, ...)`` for a rollback, ``report()`` after a checkpoint, ``finish()``
    at the end (returns the final event; rank 0)."""

    def __init__(self, run_dir: Path, rank: int = 0):
        now = time.time()
        self.run_dir, self.rank = Path(run_dir), rank
        self.job = float(os.environ.get(_ENV_JOB, now))
        self.attempt = int(os.environ.get(_ENV_ATTEMPT, "0"))
        self.t0 = float(os.environ.get(_ENV_ATTEMPT_T0, self.job if _ENV_JOB in os.environ else now))
        self.acc: dict[str, float] = defaultdict(float)
        self.n = {"steps": 0, "recomputed": 0}
        self.high = self._reached_before()  # steps up to here were reached by an earlier attempt
        self._loop_t = None

    def _reached_before(self) -> int:
        """The newest step an earlier attempt of this job reached (its ``restart`` / ``elastic``
        event's ``last_step``, its goodput events' ``last_step``); 0 for the first attempt."""
        if self.attempt == 0:
            return 0
        best = 0
        for e in read_events(self.run_dir):
            # events carry the time to the millisecond (``log_event``): one written within half a
            # millisecond of the job's start may read as before it
            if e.get("time", 0) >= self.job - 1e-3 and e.get("kind") in ("restart", "elastic", "goodput"):
                best = max(best, int(e.get("last_step") or 0))
        return best

    @contextlib.contextmanager
    def phase(self, name: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.acc[name] += time.perf_counter() - t

    def begin_steps(self) -> None:
        if self._loop_t is None:
            self._loop_t = time.time()
            self.acc["startup"] = max(0.0, self._loop_t - self.t0 - self.acc["checkpoint_load"] - self.acc["eval"])

    def step(self, step: int, seconds: float) -> None:
        kind = "recomputed" if step <= self.high else "steps"
        self.acc[kind] += seconds
        self.n[kind] += 1
        self.last_step = step

    last_step = 0

    def redo(self, at_step: int, rollback, *args):
        """``rollback(*args)`` (a rollback's reload, timed as ``checkpoint_load``); the steps up to
        ``at_step`` (the step that rolled back) will be redone (``recomputed``)."""
        self.high = max(self.high, at_step)
        with self.phase("checkpoint_load"):
            return rollback(*args)

    def snapshot(self) -> dict:
        """This attempt's seconds per category so far (``other``: the unaccounted rest since t0)."""
        wall = time.time() - self.t0
        out = {k: round(self.acc[k], 6) for k in CATEGORIES if k not in ("other", "restarts")}
        out["other"] = round(max(0.0, wall - sum(out.values())), 6)
        return {"job": self.job, "attempt": self.attempt, "wall_s": round(wall, 6), "last_step": self.last_step,
                "n_steps": self.n["steps"], "n_recomputed": self.n["recomputed"], **out}

    def report(self) -> dict | None:
        if self.rank != 0:
            return None
        return log_event(self.run_dir, "goodput", final=False, **self.snapshot())

    def finish(self, say=print) -> dict | None:
        """Rank 0: the job's ``final`` goodput event over every attempt, and its summary line."""
        if self.rank != 0:
            return None
        mine = self.snapshot()
        last: dict[int, dict] = {}
        for e in read_events(self.run_dir, "goodput"):
            if e.get("job") == self.job and not e.get("final") and e.get("attempt", 0) < self.attempt:
                last[e["attempt"]] = e  # the newest report of each earlier attempt
        totals = combine([*last.values(), mine], time.time() - self.job)
        event = log_event(self.run_dir, "goodput", final=True, job=self.job, attempts=self.attempt + 1, **totals)
        say(summary_line(totals))
        return event


def combine(attempts: list[dict], wall_s: float) -> dict:
    """The job's totals from each attempt's last snapshot: the first attempt's start-up is
    ``startup``; later attempts' start-ups and all unaccounted time are ``restarts``."""
    tot = {k: 0.0 for k in CATEGORIES}
    n_steps = n_rec = 0
    for a in attempts:
        for k in ("steps", "recomputed", "eval", "checkpoint_save", "checkpoint_load", "other"):
            tot[k] += a.get(k, 0.0)
        tot["startup" if a.get("attempt", 0) == 0 else "restarts"] += a.get("startup", 0.0)
        n_steps += a.get("n_steps", 0)
        n_rec += a.get("n_recomputed", 0)
    tot["restarts"] += max(0.0, wall_s - sum(tot.values()))
    out = {k: round(v, 3) for k, v in tot.items()}
    out.update(wall_s=round(wall_s, 3), n_steps=n_steps, n_recomputed=n_rec,
               goodput=round(tot["steps"] / wall_s, 4) if wall_s > 0 else None)
    return out


def summary_line(t: dict) -> str:
    """``goodput 93.1%: steps 41.2 s of 44.3 s wall; start-up 1.9 s, ...``"""
    pct = 100.0 * (t["goodput"] or 0.0)
    parts = [f"start-up {t['startup']:.1f} s", f"eval {t['eval']:.1f} s",
             f"checkpoint save {t['checkpoint_save']:.1f} s", f"load {t['checkpoint_load']:.1f} s",
             f"restarts {t['restarts']:.1f} s", f"recomputed {t['recomputed']:.1f} s ({t['n_recomputed']} steps)",
             f"other {t['other']:.1f} s"]
    return (f"goodput {pct:.1f}%: steps {t['steps']:.1f} s ({t['n_steps']} steps) of {t['wall_s']:.1f} s wall; "
            + ", ".join(parts))
