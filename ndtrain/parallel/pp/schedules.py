"""Pipeline schedules as per-rank action lists, each built from its formula (docs/pipeline_parallel.md,
"Schedules"): GPipe (Huang et al. 2019), 1F1B / PipeDream-Flush and interleaved 1F1B (Narayanan et
al. 2021), ZB-H1 (Qi et al. 2023), DualPipeV (DeepSeek-V3 report 2024, section 3.2.1).

Actions: ``F``, ``B`` (input-gradient part only when split), ``W`` (deferred weight gradient).
Chunk c of rank r is virtual stage ``c * p + r`` (DualPipeV: a V). Receives are posted ahead and
sends never block, so an order is deadlock-free under any timing iff it respects the dependency
graph, which ``simulate.simulate`` checks; no builder consults it. Bubbles: ``bubble_formula``."""
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
    """Per-rank action lists of one step. ``split_backward``: B is input-grad only and W exists;
    ``vshape``: rank r holds stages r and 2p-1-r; ``pairs``: per rank, indices i where actions i, i+1
    form an overlapped F&B pair (DualPipeV only)."""

    name: str
    p: int
    m: int
    v: int
    actions: list[list[Action]]
    split_backward: bool = False
    vshape: bool = False
    pairs: list[list[int]] = field(default_factory=list)

    def stage(self, rank: int, chunk: int) -> int:
        """Virtual stage of ``chunk`` on ``rank``: ``chunk * p + rank``, or ``rank`` / ``2p-1-rank`` (V)."""
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
        """(kind, mb, receiving stage) that ``a`` sends: F's output to s+1, B's input gradient to s-1; None
        off
        the last / first stage."""
        st = self.stage(rank, a.chunk)
        if a.kind == "F" and st < self.n_stages - 1:
            return ("F", a.mb, st + 1)
        if a.kind == "B" and st > 0:
            return ("B", a.mb, st - 1)
        return None

    def inbound(self, rank: int) -> dict[int, list[tuple[str, int, int]]]:
        """Per peer: the messages it sends ``rank``, in send order (the order receives are posted in).
        Messages to oneself (DualPipeV's turn on rank p-1, v > 1 with p == 1) are handed over locally."""
        out: dict[int, list[tuple[str, int, int]]] = {}
        for q in range(self.p):
            for a in self.actions[q]:
                msg = self.message(q, a)
                if q != rank and msg is not None and self.where(msg[2])[0] == rank:
                    out.setdefault(q, []).append(msg)
        return out


def bubble_formula(name: str, p: int, m: int, v: int = 1) -> float:
    """Idle fraction: (p-1)/(m+p-1) GPipe / 1F1B, (p-1)/(v*m+p-1) interleaved, (p-1)/(3m+p-1) ZB-H1,
    (p-1)/(6m+p-1) DualPipeV (equal F, B, W times; the last two simulated, exact)."""
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
    """``warmup`` forwards, then each further forward followed by the oldest pending backward."""
    warmup = min(warmup, len(fwd))
    steady = len(fwd) - warmup
    order = list(fwd[:warmup])
    for i in range(steady):
        order += [fwd[warmup + i], bwd[i]]
    return order + list(bwd[steady:])


def one_f_one_b(p: int, m: int) -> Schedule:
    """PipeDream-Flush 1F1B: rank r warms up with ``min(p-r-1, m)`` forwards."""
    fwd = [Action("F", j) for j in range(m)]
    bwd = [Action("B", j) for j in range(m)]
    return Schedule("1f1b", p, m, 1, [_one_f_one_b(fwd, bwd, p - r - 1) for r in range(p)])


def interleaved_groups(p: int, m: int) -> list[int]:
    """Microbatch group sizes: groups of p, the remainder joining the last (a smaller group would leave
    rank 0 waiting for its own chunk-0 outputs); m < p gives one group of m."""
    return [m] if m < p else [p] * (m // p - 1) + [p + m % p]


def interleaved(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B, ``v`` chunks per rank (Narayanan et al. 2021, Megatron-LM).

    Per group of g microbatches, forwards run chunk 0..v-1 and backwards v-1..0. Rank r warms up with
    ``(p-r-1)*2 + (v-1)*g_max`` chunk-forwards (capped at v*m), then 1F1B over chunk-actions; bubble
    exactly (p-1)/(v*m+p-1) for m >= p (tested for p <= 8, v <= 4, m <= 16). Raises ValueError if v < 2."""
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

    1F1B order of F and B; W_j right after B_{j+r}, the rest at the end, so input gradients race back
    in the cool-down while ranks fill waits with W. At most ``min(p, m)`` in flight; bubble
    (p-1)/(3m+p-1) with unit times and m >= p (tested)."""
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
    forwards; (2) r+1 pairs F0 F1; (3) p-r-1 times B1 W F1; (4) m-2p+r+1 times the pairs F0&B1, F1&B0;
    (5) p-r-1 times B1, F1&B0; (6) r+1 times B1 B0, W deferred in the second half; (7) p-r-1 times
    W B0; (8) the r+1 W left. Raises ValueError if m < 2p."""
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
    """The schedule ``name`` ("gpipe" | "1f1b" | "interleaved" | "zero_bubble" | "dualpipev") for p, m, v.
    Raises ValueError for an unknown name, m < 1, p < 1, v != 1 outside interleaved, v < 2 with it,
    m < 2p with DualPipeV."""
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
    """Evaluation: F only, microbatches and chunks in order; with the V placement all chunk-0 forwards
    first (microbatches stream down and back up without waiting)."""
    if vshape:
        acts = [[Action("F", j, c) for c in range(2) for j in range(m)] for _ in range(p)]
        return Schedule("forward_only", p, m, 2, acts, vshape=True)
    acts = [[Action("F", j, c) for j in range(m) for c in range(v)] for _ in range(p)]
    return Schedule("forward_only", p, m, v, acts)
