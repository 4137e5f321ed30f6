"""Simulate pipeline schedules: check an order is complete and deadlock-free, and time it.

``simulate`` runs each rank's list against the others with the runtime's semantics (receives
posted ahead, sends never block); an order that simulates is consistent with the dependency graph,
so it runs without deadlock under any timing. ``Timeline.bubble(rank)`` is the formulas' idle
fraction (measured timelines use the same class). Only the tests and ``viz`` call it."""
from __future__ import annotations

from dataclasses import dataclass, field

from ndtrain.parallel.pp.schedules import Action, Schedule


class DeadlockError(RuntimeError):
    """No rank can progress (args: message, stuck ranks)."""


@dataclass
class Event:
    """A timed action: ``start`` / ``end`` in the timeline's unit (simulated units or seconds)."""

    kind: str
    mb: int
    chunk: int
    start: float
    end: float


@dataclass
class Timeline:
    """Per-rank events of one step (planned or measured), with bubble accounting."""

    p: int
    events: list[list[Event]]
    name: str = ""
    m: int = 0
    v: int = 1
    meta: dict = field(default_factory=dict)

    @property
    def start(self) -> float:
        return min(e.start for evs in self.events for e in evs)

    @property
    def end(self) -> float:
        return max(e.end for evs in self.events for e in evs)

    def busy(self, rank: int) -> float:
        return sum(e.end - e.start for e in self.events[rank])

    def bubble(self, rank: int) -> float:
        """Idle fraction of rank ``rank`` over the step (first start to last end over all ranks)."""
        span = self.end - self.start
        return 1.0 - self.busy(rank) / span if span > 0 else 0.0

    def bubbles(self) -> list[float]:
        return [self.bubble(r) for r in range(self.p)]


def dependencies(s: Schedule, rank: int, a: Action) -> list[tuple[int, Action]]:
    """The (rank, action) pairs that must finish before ``a`` runs on ``rank``."""
    st = s.stage(rank, a.chunk)
    deps: list[tuple[int, Action]] = []
    if a.kind == "F" and st > 0:
        r, c = s.where(st - 1)
        deps.append((r, Action("F", a.mb, c)))
    if a.kind == "B":
        deps.append((rank, Action("F", a.mb, a.chunk)))
        if st < s.n_stages - 1:
            r, c = s.where(st + 1)
            deps.append((r, Action("B", a.mb, c)))
    if a.kind == "W":
        deps.append((rank, Action("B", a.mb, a.chunk)))
    return deps


def check_complete(s: Schedule) -> None:
    """Raise ValueError unless every rank runs each F and B (and W when split) exactly once."""
    kinds = ("F", "B", "W") if s.split_backward else ("F", "B")
    want = sorted((k, j, c) for k in kinds for j in range(s.m) for c in range(s.v))
    for r, acts in enumerate(s.actions):
        got = sorted((a.kind, a.mb, a.chunk) for a in acts)
        if got != want:
            raise ValueError(f"rank {r}: actions are not each F/B{'/W' if s.split_backward else ''} "
                             f"exactly once")


def simulate(s: Schedule, t_f: float = 1.0, t_b: float | None = None, t_w: float = 1.0,
             comm: float = 0.0, rendezvous: bool = False) -> Timeline:
    """The planned timeline of ``schedule``: a rank waits only for its next action's inputs (``comm``
    after the producer finished). ``rendezvous=True`` models blocking p2p (a send completes when the
    receiver consumes it), which deadlocks 1F1B: the test of the checker. Durations: F ``t_f``; B
    ``t_b`` (default 2 t_f, t_f when split); W ``t_w``. Raises DeadlockError if no rank can progress."""
    check_complete(s)
    if t_b is None:
        t_b = t_f if s.split_backward else 2 * t_f
    dur = {"F": t_f, "B": t_b, "W": t_w}
    pos = [0] * s.p
    free = [0.0] * s.p
    end: dict[tuple[int, Action], float] = {}
    events: list[list[Event]] = [[] for _ in range(s.p)]
    pending_send: list[tuple[int, Action] | None] = [None] * s.p  # rendezvous: blocked sender
    total = sum(len(a) for a in s.actions)
    done = 0
    while done < total:
        progressed = False
        for r in range(s.p):
            if rendezvous and pending_send[r] is not None:
                dst, consumer = pending_send[r]
                at_recv = (pending_send[dst] is None and pos[dst] < len(s.actions[dst])
                           and s.actions[dst][pos[dst]] == consumer)
                if at_recv or (dst, consumer) in end:  # the receiver posted its receive
                    pending_send[r] = None
                    progressed = True
                else:
                    continue
            if pos[r] >= len(s.actions[r]):
                continue
            a = s.actions[r][pos[r]]
            deps = dependencies(s, r, a)
            if any(d not in end for d in deps):
                continue
            ready = max([free[r]] + [end[d] + (comm if d[0] != r else 0.0) for d in deps])
            t1 = ready + dur[a.kind]
            end[(r, a)] = t1
            events[r].append(Event(a.kind, a.mb, a.chunk, ready, t1))
            free[r] = t1
            pos[r] += 1
            done += 1
            progressed = True
            if rendezvous:
                pending_send[r] = _consumer(s, r, a)
        if not progressed:
            stuck = [r for r in range(s.p) if pos[r] < len(s.actions[r]) or pending_send[r]]
            waits = {r: (str(s.actions[r][pos[r]]) if pos[r] < len(s.actions[r]) else "send")
                     for r in stuck}
            raise DeadlockError(f"{s.name} p={s.p} m={s.m} v={s.v} deadlocks; waiting: {waits}", stuck)
    return Timeline(s.p, events, s.name, s.m, s.v)


def _consumer(s: Schedule, rank: int, a: Action) -> tuple[int, Action] | None:
    """(rank, action) that consumes the message ``a`` sends, or None if it sends nothing."""
    msg = s.message(rank, a)
    if msg is None:
        return None
    r, c = s.where(msg[2])
    return r, Action(msg[0], a.mb, c)


def peak_in_flight(s: Schedule) -> list[int]:
    """Per rank, the most microbatch-chunks holding activations at once (F done, backward not): the memory
    bound."""
    out = []
    last = "W" if s.split_backward else "B"
    for acts in s.actions:
        cur = peak = 0
        for a in acts:
            cur += 1 if a.kind == "F" else (-1 if a.kind == last else 0)
            peak = max(peak, cur)
        out.append(peak)
    return out
