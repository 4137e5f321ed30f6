"""Pipeline schedules as explicit per-rank action lists, each built directly from its formula.

A schedule for ``p`` ranks, ``m`` microbatches and ``v`` model chunks per rank is, for every rank, the
ordered list of compute actions it runs in one optimizer step:

* ``F`` (forward of microbatch ``mb`` through chunk ``chunk``),
* ``B`` (backward; the full backward, or only the input-gradient part when the schedule splits it),
* ``W`` (weight-gradient part of the backward; split schedules only).

Chunk ``c`` of rank ``r`` is virtual stage ``s = c * p + r`` (Megatron's interleaved placement), so
a microbatch visits ranks 0, 1, ..., p-1, 0, 1, ... in its forward. Messages follow from the
actions (``Schedule.message``): the output of ``F`` at stage s goes to stage s+1, the input gradient
of ``B`` at stage s to stage s-1. The runtime posts every receive ahead of time and never blocks on
a send, so an order is deadlock-free under *any* timing iff it is consistent with the dependency
graph; ``simulate.simulate`` checks exactly that (and times it). No builder consults the simulator.

Schedules (any ``m >= 1``; ``m`` smaller than or not a multiple of ``p`` included):

* GPipe (Huang et al. 2019): all forwards, then all backwards. Bubble (p-1)/(m+p-1); keeps all m
  microbatches' activations.
* 1F1B, PipeDream-Flush (Narayanan et al. 2021, "Memory-efficient pipeline-parallel DNN training"):
  warm-up of ``p-r-1`` forwards, steady one-forward-one-backward, cool-down. Same bubble as GPipe,
  at most ``min(p-r, m)`` microbatches in flight on rank r.
* Interleaved 1F1B (Narayanan et al. 2021, "Efficient large-scale language model training on GPU
  clusters using Megatron-LM"): v chunks per rank, microbatches in groups of p; warm-up of
  ``(p-r-1)*2 + (v-1)*g`` chunk-forwards; bubble (p-1)/(v*m+p-1) when m >= p.
* ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): backward split into B (input grad,
  on the critical path) and W (weight grad, deferred to fill bubbles), in-flight limit as 1F1B.
  With equal F/B/W times the bubble is (p-1)/(3m+p-1), a third of 1F1B's.
* DualPipeV (DeepSeek-V3 technical report 2024, section 3.2.1; the "cut-in-half" V form of its
  DualPipe, as in the DualPipe repository): 2 chunks per rank placed as a V -- rank r holds
  virtual stage r (chunk 0) and 2p-1-r (chunk 1), so a microbatch goes down the ranks and back up,
  rank 0 holding the embedding and the head. After a warm-up each rank runs overlapped pairs
  "F of one microbatch + B of another" (chunk 0 forward with chunk 1 backward, then the reverse):
  on a GPU the two run on separate streams, so one's expert all-to-all hides under the other's
  compute; here the pair is two consecutive actions (``Schedule.pairs``). Backwards of the warm-up
  and cool-down are split (B then a deferred W, zero-bubble style) to fill the ramps. Needs
  m >= 2p. With equal F, B, W times per chunk a rank works 6m units and idles p-1 (simulated,
  exact): bubble (p-1)/(6m+p-1), i.e. (p-1) F/2 of a whole rank's forward F -- half of ZB-H1's
  (p-1)/(3m+p-1) -- with 2p+1 chunk-activations (p + 1/2 microbatches' worth) in flight per rank.
"""
from __future__ import annotations

from dataclasses import dataclass, field

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble", "dualpipev")
CHUNKS = {"dualpipev": 2}  # schedules that fix the chunks per rank (pp_virtual_stages stays 1)


@dataclass(frozen=True)
class Action:
    """One compute action of a rank: ``kind`` in "F" | "B" | "W", microbatch ``mb``, ``chunk``."""

    kind: str
    mb: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


@dataclass
class Schedule:
    """Per-rank action lists of one step. ``split_backward``: B is input-grad only and W exists.
    ``vshape``: DualPipeV placement (rank r holds stages r and 2p-1-r) instead of the loop
    placement ``chunk * p + rank``. ``pairs``: per rank, indices i such that actions i and i+1
    form an overlapped forward-backward pair (DualPipeV; empty elsewhere)."""

    name: str
    p: int
    m: int
    v: int
    actions: list[list[Action]]
    split_backward: bool = False
    vshape: bool = False
    pairs: list[list[int]] = field(default_factory=list)

    def stage(self, rank: int, chunk: int) -> int:
        """Virtual stage index of ``chunk`` on ``rank``: ``chunk * p + rank`` (loop placement), or
        ``rank`` / ``2p - 1 - rank`` for chunk 0 / 1 (V placement)."""
        if self.vshape:
            return rank if chunk == 0 else 2 * self.p - 1 - rank
        return chunk * self.p + rank

    def where(self, stage: int) -> tuple[int, int]:
        """(rank, chunk) holding virtual stage ``stage``."""
        if self.vshape:
            return (stage, 0) if stage < self.p else (2 * self.p - 1 - stage, 1)
        return stage % self.p, stage // self.p

    @property
    def n_stages(self) -> int:
        return self.p * self.v

    def message(self, rank: int, a: Action) -> tuple[str, int, int] | None:
        """What ``a`` on ``rank`` sends, as (kind, mb, receiving stage): an F off the last stage sends
        its output ("F", mb, s+1), a B off stage 0 its input gradient ("B", mb, s-1); else None."""
        st = self.stage(rank, a.chunk)
        if a.kind == "F" and st < self.n_stages - 1:
            return ("F", a.mb, st + 1)
        if a.kind == "B" and st > 0:
            return ("B", a.mb, st - 1)
        return None

    def inbound(self, rank: int) -> dict[int, list[tuple[str, int, int]]]:
        """Per peer rank: the messages it sends to ``rank``, in the order it sends them (the order its
        receiver must post receives in). Messages a rank sends itself (DualPipeV's turn of the V on
        rank p-1, or v > 1 with p == 1) are handed over locally by the runtime, not listed."""
        out: dict[int, list[tuple[str, int, int]]] = {}
        for q in range(self.p):
            for a in self.actions[q]:
                msg = self.message(q, a)
                if q != rank and msg is not None and self.where(msg[2])[0] == rank:
                    out.setdefault(q, []).append(msg)
        return out


def bubble_formula(name: str, p: int, m: int, v: int = 1) -> float:
    """Idle fraction of a step: (p-1)/(m+p-1) for GPipe / 1F1B, (p-1)/(v*m+p-1) interleaved
    (Narayanan 2021), (p-1)/(3m+p-1) for ZB-H1 with equal F, B, W times (Qi 2023); DualPipeV with
    equal F, B, W times per chunk: (p-1)/(6m+p-1) (``dualpipev``; simulated, exact)."""
    if name == "dualpipev":
        return (p - 1) / (6 * m + p - 1)
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if name == "zero_bubble":
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (m + p - 1)


# --- builders -------------------------------------------------------------------------------------
def gpipe(p: int, m: int) -> Schedule:
    """GPipe: every rank runs F0..F(m-1), then B0..B(m-1)."""
    acts = [[Action("F", j) for j in range(m)] + [Action("B", j) for j in range(m)] for _ in range(p)]
    return Schedule("gpipe", p, m, 1, acts)


def _one_f_one_b(fwd: list[Action], bwd: list[Action], warmup: int) -> list[Action]:
    """Warm-up: the first ``warmup`` forwards. Steady state: each further forward followed by the
    oldest pending backward. Cool-down: the backwards left."""
    warmup = min(warmup, len(fwd))
    steady = len(fwd) - warmup
    order = list(fwd[:warmup])
    for i in range(steady):
        order += [fwd[warmup + i], bwd[i]]
    return order + list(bwd[steady:])


def one_f_one_b(p: int, m: int) -> Schedule:
    """PipeDream-Flush 1F1B: rank r warms up with ``min(p-r-1, m)`` forwards (the microbatches in
    flight below it when its first backward can arrive)."""
    fwd = [Action("F", j) for j in range(m)]
    bwd = [Action("B", j) for j in range(m)]
    return Schedule("1f1b", p, m, 1, [_one_f_one_b(fwd, bwd, p - r - 1) for r in range(p)])


def interleaved_groups(p: int, m: int) -> list[int]:
    """Microbatch group sizes: groups of p, the remainder of m / p joining the last group (a group
    smaller than p would leave rank 0 waiting for its own chunk-0 outputs to come round the ring);
    m < p gives one group of m."""
    return [m] if m < p else [p] * (m // p - 1) + [p + m % p]


def interleaved(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B with ``v`` chunks per rank (Narayanan et al. 2021, Megatron-LM).

    Chunk order: per group of g microbatches (``interleaved_groups``), forwards run chunk 0 for the
    group's microbatches, then chunk 1, ..., chunk v-1; backwards the same with chunks descending.
    Rank r warms up with ``(p-r-1)*2 + (v-1)*g_max`` chunk-forwards (capped at v*m): ``(v-1)*g_max``
    is the distance, in the forward order, from a chunk-0 forward to the last-chunk forward whose
    backward comes first, and ``2`` per rank below covers a forward's trip down the ring and its
    gradient's trip back (Megatron's warm-up, with g_max = p when p divides m). Then 1F1B over
    chunk-actions. Deadlock-free and with bubble exactly (p-1)/(v*m+p-1) for m >= p (tested for
    p <= 8, v <= 4, m <= 16). Raises ValueError if ``v < 2``.
    """
    if v < 2:
        raise ValueError(f"interleaved schedule needs pp_virtual_stages >= 2 (got {v})")
    fwd: list[Action] = []
    bwd: list[Action] = []
    start = 0
    sizes = interleaved_groups(p, m)
    for size in sizes:
        group = range(start, start + size)
        start += size
        for c in range(v):
            fwd += [Action("F", j, c) for j in group]
            bwd += [Action("B", j, v - 1 - c) for j in group]
    lag = (v - 1) * max(sizes)
    acts = [_one_f_one_b(fwd, bwd, (p - r - 1) * 2 + lag) for r in range(p)]
    return Schedule("interleaved", p, m, v, acts)


def zero_bubble_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023): B = input gradient (critical path), W = weight gradient (deferred).

    Rank r runs the 1F1B order of F and B, and puts W_j right after B_{j+r} (the rest at the end):
    later ranks defer more W passes, so in the cool-down the input gradients race back to rank 0
    while every rank fills its waits with weight gradients. At most ``min(p, m)`` microbatches
    are in flight per rank (1F1B's peak). With unit F, B, W times and m >= p the simulated bubble
    is exactly (p-1)/(3m+p-1), a third of 1F1B's (tested).
    """
    fwd = [Action("F", j) for j in range(m)]
    bwd = [Action("B", j) for j in range(m)]
    acts = []
    for r in range(p):
        order: list[Action] = []
        for a in _one_f_one_b(fwd, bwd, p - r - 1):
            order.append(a)
            if a.kind == "B" and a.mb >= r:
                order.append(Action("W", a.mb - r))
        acts.append(order + [Action("W", j) for j in range(max(m - r, 0), m)])
    return Schedule("zero_bubble", p, m, 1, acts, split_backward=True)


def dualpipev(p: int, m: int) -> Schedule:
    """DualPipeV (DeepSeek-V3 report, section 3.2.1; the V schedule of the DualPipe repository).

    Rank r (chunk 0 = stage r, chunk 1 = stage 2p-1-r) runs eight phases: (1) 2(p-r-1) chunk-0
    forwards; (2) r+1 pairs F0 F1; (3) p-r-1 times B1 W F1 (zero-bubble B); (4) m-2p+r+1 times the
    overlapped pairs F0&B1 then F1&B0; (5) p-r-1 times B1, F1&B0; (6) r+1 times B1 B0, the second
    half with W deferred; (7) p-r-1 times W B0 (deferred W); (8) the r+1 W left. Microbatches pass
    each chunk in order 0..m-1; a W not deferred follows its B at once. Raises ValueError if
    m < 2p (phase 4 would run a negative number of times).
    """
    if m < 2 * p:
        raise ValueError(f"pp_schedule=dualpipev needs microbatches m ({m}) >= 2 * pp ({2 * p})")
    ranks = [_dualpipev_rank(p, m, r) for r in range(p)]
    acts, pairs = [a for a, _ in ranks], [q for _, q in ranks]
    return Schedule("dualpipev", p, m, 2, acts, split_backward=True, vshape=True, pairs=pairs)


def _dualpipev_rank(p: int, m: int, r: int) -> tuple[list[Action], list[int]]:
    """Rank r's DualPipeV order and the indices of its overlapped F&B pairs (``dualpipev``)."""
    order: list[Action] = []
    pair: list[int] = []
    queue: list[Action] = []  # deferred W passes, oldest first
    nxt = {("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0}  # next microbatch per (kind, chunk)

    def run(kind: str, chunk: int, zb: bool = False, overlap: bool = False) -> None:
        if overlap:  # this action and the next form one overlapped F&B pair
            pair.append(len(order))
        a = Action(kind, nxt[(kind, chunk)], chunk)
        nxt[(kind, chunk)] += 1
        order.append(a)
        if kind == "B":
            (queue.append if zb else order.append)(Action("W", a.mb, chunk))

    for _ in range(2 * (p - r - 1)):
        run("F", 0)
    for _ in range(r + 1):
        run("F", 0), run("F", 1)
    for _ in range(p - r - 1):
        run("B", 1, zb=True), order.append(queue.pop(0)), run("F", 1)
    for _ in range(m - 2 * p + r + 1):
        run("F", 0, overlap=True), run("B", 1), run("F", 1, overlap=True), run("B", 0)
    for _ in range(p - r - 1):
        run("B", 1), run("F", 1, overlap=True), run("B", 0)
    zb = False
    for i in range(r + 1):  # the second half of these backwards defer their W
        zb = zb or (i == (r + 1) // 2 and r % 2 == 1)
        run("B", 1, zb=zb)
        zb = zb or (i == (r + 1) // 2 and r % 2 == 0)
        run("B", 0, zb=zb)
    for _ in range(p - r - 1):
        order.append(queue.pop(0)), run("B", 0, zb=True)
    return order + queue, pair


def build_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule ``name`` ("gpipe" | "1f1b" | "interleaved" | "zero_bubble" | "dualpipev") for
    p, m, v (v = the chunks per rank: 2 for DualPipeV, whatever is passed).

    Raises ValueError for an unknown name, ``m < 1``, ``p < 1``, ``v != 1`` with a non-interleaved
    schedule or ``v < 2`` with the interleaved one, ``m < 2p`` with DualPipeV.
    """
    if p < 1 or m < 1:
        raise ValueError(f"pipeline needs p >= 1 and m >= 1 (got p={p}, m={m})")
    if name == "dualpipev":
        return dualpipev(p, m)
    if name != "interleaved" and v != 1:
        raise ValueError(f"pp_virtual_stages ({v}) > 1 needs pp_schedule=interleaved (got {name})")
    if name == "gpipe":
        return gpipe(p, m)
    if name == "1f1b":
        return one_f_one_b(p, m)
    if name == "interleaved":
        return interleaved(p, m, v)
    if name == "zero_bubble":
        return zero_bubble_h1(p, m)
    raise ValueError(f"unknown pipeline schedule {name!r}; known: {', '.join(SCHEDULES)}")


def forward_only(p: int, m: int, v: int = 1, vshape: bool = False) -> Schedule:
    """Evaluation: every rank runs F(mb, chunk) for mb in order, chunks in order (no backward); with
    the V placement every chunk-0 forward first, then every chunk-1 forward (the microbatches
    stream down the ranks and back up without waiting for each other)."""
    if vshape:
        acts = [[Action("F", j, c) for c in range(2) for j in range(m)] for _ in range(p)]
        return Schedule("forward_only", p, m, 2, acts, vshape=True)
    acts = [[Action("F", j, c) for j in range(m) for c in range(v)] for _ in range(p)]
    return Schedule("forward_only", p, m, v, acts)
