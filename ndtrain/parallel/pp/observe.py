"""Observers of the pipeline runtime, kept out of its hot path (none attached: no timing at all).

Hooks: ``on_step_start`` / ``on_step_end`` (also on error), and per action ``on_wait``,
``on_action_start``, ``on_action_end``. ``ActionTimer``: wall-clock events and input waits
(``viz.gather_measured_timeline``); ``Jitter``: random sleeps for the deadlock tests;
``ActivationMemory``: ``mem_account.ActivationMeter`` over a training step."""
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
    """Times every action of the last step: ``events`` (seconds since the epoch), ``wait_s`` (input
    waits), ``name``, ``m``, ``v``."""

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
    """Sleeps uniform(0, ``max_s``) before each action, seeded ``seed * 1000 + rank`` (reproducible)."""

    def __init__(self, max_s: float, seed: int = 0, rank: int = 0):
        self.max_s = max_s
        self.rng = random.Random(seed * 1000 + rank)

    def on_wait(self, a: Action) -> None:
        time.sleep(self.rng.uniform(0.0, self.max_s))


class ActivationMemory(RuntimeObserver):
    """Peak live activation bytes per training step (``peak_bytes``); slows the step it meters."""

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
