"""Straggler report: per-rank step, data-loading and busy-time percentiles gathered at each log row.

In synchronous training every rank's *wall* step time is the same -- the collectives make the fast
ranks wait for the slowest -- so wall time cannot say who is slow. Each rank therefore also
measures its **busy time**: the step's wall time minus the seconds it spent blocked in collective
waits (``FlightRecorder.wait_s``, ``ndtrain.parallel.flight_recorder``), plus its data-loading
time. A straggler has the largest busy time; its peers show the difference as waiting. (On CUDA a
collective's ``wait()`` does not block the host, so there the busy time is the wall time and only
data-loading differences show; measure kernels with a profiler.)

At each log row ``StragglerMonitor.report`` all-gathers (one all-gather over the world of 9 floats
per rank) the p50 / p90 / max over the log window of each rank's step, data and busy times, and
rank 0 adds to the metrics row:

* ``step_time_p50_s`` / ``_p90_s`` / ``_max_s``, ``data_time_*``, ``busy_time_*``: over the ranks,
  the median of the per-rank p50s, the max of the per-rank p90s and the max of the maxima;
* ``slowest_rank`` (largest busy p50 + data p50) and ``slowest_vs_median`` (its ratio to the median
  rank's); above ``THRESHOLD`` (1.10: more than 10% slower) and ``MIN_GAP_S`` (5 ms per step)
  slower, a ``straggler`` event goes to
  ``events.jsonl`` and one console line names the rank;
* ``per_rank``: each rank's [step p50, data p50, busy p50] (for plots; small for CPU-sized runs).
"""
from __future__ import annotations

import statistics
from pathlib import Path

import torch

from ndtrain.events import log_event
from ndtrain.mesh import AxisGroup
from ndtrain.parallel import comm, flight_recorder

THRESHOLD = 1.10  # the slowest rank is reported when its time exceeds the median rank's by 10%
MIN_GAP_S = 0.005  # ... and by at least 5 ms per step (a ratio of two sub-millisecond times is noise)


def percentiles(xs: list[float]) -> tuple[float, float, float]:
    """(p50, p90, max) of ``xs`` by nearest rank (0s for an empty list)."""
    if not xs:
        return 0.0, 0.0, 0.0
    s = sorted(xs)
    def pick(q: float) -> float:
        return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]

    return pick(0.5), pick(0.9), s[-1]


class StragglerMonitor:
    """Collects this rank's per-step times; ``report`` (collective over ``group``) summarises them.

    Args:
        group: the whole world (``ndtrain.fault.bad_steps.world_group``).
        device: where the gathered tensor lives (the collective's device).
    """

    def __init__(self, group: AxisGroup, device: torch.device):
        self.group, self.device = group, device
        self.step_s: list[float] = []
        self.data_s: list[float] = []
        self.busy_s: list[float] = []
        self._wait_mark = flight_recorder.recorder().wait_s

    def record(self, step_s: float, data_s: float) -> None:
        """One step: its wall time and data-loading time (seconds); the busy time is derived from
        the collective waits since the previous call."""
        rec = flight_recorder.recorder()
        waited, self._wait_mark = rec.wait_s - self._wait_mark, rec.wait_s
        self.step_s.append(step_s)
        self.data_s.append(data_s)
        self.busy_s.append(max(step_s - waited, 0.0))

    def report(self, run_dir: Path | None = None, step: int = 0) -> dict:
        """Gather every rank's window percentiles (collective); rank 0 gets the row fields, the
        others ``{}``. Clears the window. A straggler event is logged by rank 0."""
        mine = [v for xs in (self.step_s, self.data_s, self.busy_s) for v in percentiles(xs)]
        self.step_s, self.data_s, self.busy_s = [], [], []
        local = torch.tensor(mine, dtype=torch.float64, device=self.device)
        every = torch.empty(self.group.size * 9, dtype=torch.float64, device=self.device)
        comm.all_gather_into(every, local, self.group)
        if self.group.rank != 0:
            return {}
        rows = every.view(self.group.size, 9).tolist()  # (ranks, [step, data, busy] x [p50, p90, max])
        out = {}
        for j, name in enumerate(("step_time", "data_time", "busy_time")):
            out[f"{name}_p50_s"] = statistics.median(r[3 * j] for r in rows)
            out[f"{name}_p90_s"] = max(r[3 * j + 1] for r in rows)
            out[f"{name}_max_s"] = max(r[3 * j + 2] for r in rows)
        own = [r[6] + r[3] for r in rows]  # busy p50 + data p50: the rank's own work per step
        slowest = max(range(len(own)), key=own.__getitem__)
        median = statistics.median(own)
        ratio = own[slowest] / median if median > 0 else 1.0
        out.update({"slowest_rank": slowest, "slowest_vs_median": ratio,
                    "per_rank": [[r[0], r[3], r[6]] for r in rows]})
        if ratio > THRESHOLD and own[slowest] - median >= MIN_GAP_S and len(rows) > 1:
            print(f"straggler: rank {slowest} is {100 * (ratio - 1):.0f}% slower than the median rank "
                  f"({own[slowest]:.3f} s vs {median:.3f} s of own work per step)", flush=True)
            if run_dir is not None:
                log_event(run_dir, "straggler", step=step, rank=slowest, ratio=ratio,
                          own_s=own[slowest], median_s=median)
        return out
