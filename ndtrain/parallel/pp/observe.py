"""Instrumentation of the pipeline runtime, kept out of its hot path: observers with hooks.

``PipelineRuntime.run`` calls, for each attached observer (``runtime.observers``; none by default,
and then it does no timing, metering or sleeping at all):

* ``on_step_start(runtime, schedule, train)`` and ``on_step_end()`` (the latter also on error),
* per action of the rank's schedule: ``on_wait(action)`` before its input is awaited,
  ``on_action_start(action)`` once the input is there (compute starts), ``on_action_end(action)``.

Observers here:

* ``ActionTimer``: wall-clock start / end of every action (``time.time()``, comparable across local
  processes) and the time spent waiting for inputs; ``viz.gather_measured_timeline`` turns the
  ranks' events into a measured ``Timeline`` (bubble per rank, as in Narayanan et al. 2021).
* ``Jitter``: sleeps uniform(0, max_s) before each action's wait (deadlock tests: any timing must
  give the same results).
* ``ActivationMemory``: ``ndtrain.mem_account.ActivationMeter`` over a whole training step, i.e.
  the peak bytes of live activation storages (saved activations, activation gradients, buffers
  in flight); ``peak_bytes`` after the step.
"""
from __future__ import annotations

import random
import threading
import time

from ndtrain.parallel.pp.schedules import Action
from ndtrain.parallel.pp.simulate import Event


class RuntimeObserver:
    """Base class: every hook is a no-op; override the ones you need."""

    def on_step_start(self, runtime, schedule, train: bool) -> None:
        pass

    def on_wait(self, a: Action) -> None:
        pass

    def on_action_start(self, a: Action) -> None:
        pass

    def on_action_end(self, a: Action) -> None:
        pass

    def on_step_end(self) -> None:
        pass


class ActionTimer(RuntimeObserver):
    """Times every action of the last step. ``events``: ``Event``s (start / end in seconds since the
    epoch); ``wait_s``: total seconds spent waiting for inputs; ``name``, ``m``, ``v``: the step's
    schedule."""

    def __init__(self):
        self.events: list[Event] = []
        self.wait_s = 0.0
        self.name, self.m, self.v = "", 0, 1
        self._t_wait: dict[Action, float] = {}  # by action: an overlapped pair's B times from a thread
        self._t0: dict[Action, float] = {}
        self._lock = threading.Lock()

    def on_step_start(self, runtime, schedule, train: bool) -> None:
        self.events, self.wait_s = [], 0.0
        self.name, self.m, self.v = schedule.name, schedule.m, schedule.v

    def on_wait(self, a: Action) -> None:
        self._t_wait[a] = time.time()

    def on_action_start(self, a: Action) -> None:
        self._t0[a] = t = time.time()
        with self._lock:
            self.wait_s += t - self._t_wait.pop(a, t)

    def on_action_end(self, a: Action) -> None:
        self.events.append(Event(a.kind, a.mb, a.chunk, self._t0.pop(a), time.time()))


class Jitter(RuntimeObserver):
    """Sleeps uniform(0, ``max_s``) seconds before each action (seeded per rank: ``seed * 1000 +
    rank``), so ranks run with different, reproducible random timings."""

    def __init__(self, max_s: float, seed: int = 0, rank: int = 0):
        self.max_s = max_s
        self.rng = random.Random(seed * 1000 + rank)

    def on_wait(self, a: Action) -> None:
        time.sleep(self.rng.uniform(0.0, self.max_s))


class ActivationMemory(RuntimeObserver):
    """Peak live activation bytes of each training step (``peak_bytes``; forward-only steps are not
    metered). Slows the step it meters (a dispatch mode sees every operator)."""

    def __init__(self):
        self.peak_bytes = 0
        self._meter = None

    def on_step_start(self, runtime, schedule, train: bool) -> None:
        if not train:
            return
        from ndtrain.mem_account import ActivationMeter

        self._meter = ActivationMeter([q for c in runtime.chunks for q in c.parameters()])
        self._meter.__enter__()

    def on_step_end(self) -> None:
        if self._meter is not None:
            self._meter.__exit__(None, None, None)
            self.peak_bytes, self._meter = self._meter.peak, None
