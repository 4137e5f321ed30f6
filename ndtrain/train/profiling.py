"""``torch.profiler`` Chrome traces of a window of training steps (``logging.profile_steps``).

Contract (``ndtrain train --profile-steps A:B``, same as ``--logging.profile_steps=A:B``; ``--profile``
alone means ``DEFAULT_WINDOW``): steps A through B inclusive, 1-based optimizer steps as in
``metrics.jsonl``, are recorded on every rank, and rank R writes
``RUN_DIR/profile/trace_steps_A-B_rank_R.json`` (Chrome trace format: open it in
``chrome://tracing`` or https://ui.perfetto.dev) once step B ends. CPU activity is always recorded,
CUDA kernels too on a GPU run; operator input shapes are recorded (``record_shapes``) so a slow
matmul can be told from a slow elementwise op. Each step is a ``ProfilerStep#N`` range. A window
that ends after the job's last step is closed and written when the loop ends; a window the run has
already passed (a resumed run) records nothing. The profiler slows the steps it records: their
``tokens_per_s`` in ``metrics.jsonl`` is not representative.

The window is parsed by ``ndtrain.config.validate.parse_profile_steps`` (a config rule, torch-free).

Beside the trace, rank R writes ``RUN_DIR/profile/breakdown_steps_A-B_rank_R.json``: the window's
steps split into phases by wall-clock spans (``StepBreakdown``), so a slower step shows where it is.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from ndtrain.config.validate import parse_profile_steps
from ndtrain.parallel.flight_recorder import recorder
from ndtrain.parallel.pp.observe import RuntimeObserver

DEFAULT_WINDOW = "2:3"  # step 1 pays allocation and warm-up; two steady steps show the pattern


def trace_path(run_dir: Path, window: tuple[int, int], rank: int) -> Path:
    """Where rank ``rank`` writes the trace of ``window``."""
    return Path(run_dir) / "profile" / f"trace_steps_{window[0]}-{window[1]}_rank_{rank}.json"


class StepProfiler:
    """Starts ``torch.profiler`` before step A and writes the trace after step B (module docstring).

    Use: ``begin(step)`` before each step's work, ``end(step)`` after it, ``close()`` after the loop.
    Inactive (every call a no-op) when ``spec`` is empty."""

    def __init__(self, spec: str, run_dir: Path, rank: int, device_type: str, trainer=None):
        self.window = parse_profile_steps(spec)
        self.run_dir, self.rank, self.device_type = Path(run_dir), rank, device_type
        self.prof = None
        self._range = None
        self.path: Path | None = None
        self.breakdown = StepBreakdown(trainer) if trainer is not None and self.window else None
        self.breakdown_path: Path | None = None

    def begin(self, step: int) -> None:
        if self.window is None or not self.window[0] <= step <= self.window[1]:
            return
        import torch
        from torch.profiler import ProfilerActivity, profile

        if self.prof is None:
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device_type == "cuda" else [])
            self.prof = profile(activities=acts, record_shapes=True)
            self.prof.__enter__()
            if self.breakdown is not None:
                self.breakdown.attach()
        self._range = torch.autograd.profiler.record_function(f"ProfilerStep#{step}")
        self._range.__enter__()

    def end(self, step: int) -> None:
        if self.prof is None:
            return
        self._end_range()
        if step >= self.window[1]:
            self.close()

    def _end_range(self) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None

    def close(self) -> None:
        """Stop recording and write the trace (if recording); idempotent."""
        if self.prof is None:
            return
        self._end_range()
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        self.path = trace_path(self.run_dir, self.window, self.rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.path))
        if self.breakdown is not None:
            self.breakdown.detach()
            self.breakdown_path = self.path.parent / self.path.name.replace("trace_", "breakdown_")
            self.breakdown_path.write_text(json.dumps(self.breakdown.report(), indent=1))


PHASES = ("forward", "backward", "optimizer", "comm_wait", "bookkeeping")


class StepBreakdown(RuntimeObserver):
    """Each ``Trainer.step`` split into ``PHASES`` (seconds) by wall-clock spans on the step's thread:

    * ``forward`` / ``backward``: the pipeline runtime's F and B / W actions (at pp = 1 too),
      less the communication waits inside them (tensor / sequence parallel collectives);
    * ``optimizer``: ``Trainer._update`` (clipping, the bad-step agreement, the optimizer and LR
      step, zeroing) less its waits;
    * ``comm_wait``: every wait of the counted primitives (``ndtrain.parallel.comm``, pipeline
      receives; ``FlightRecorder.wait_s``) within the step;
    * ``bookkeeping``: the rest of the step (moving and sharding the batch, the batch agreement's
      launch, memory sampling, the runtime's dispatch, the loss reduction's launch).

    The phases sum to the step's span. An overlapped F&B pair (DualPipeV) computes B in a thread beside
    F: only the part of B after F ends is ``backward``; ``overlapped_s`` holds B's whole thread time.
    ``attach()`` wraps the trainer's ``step`` and ``_update`` (instance attributes) and joins the
    runtime's observers; ``detach()`` undoes both. ``steps``: one dict per step (``step_s`` + phases)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.steps: list[dict] = []
        self._cur: dict | None = None
        self._t_action = self._w_action = 0.0
        self._main_end = self._thread_end = None
        self._thread_start = 0.0
        self._lock = threading.Lock()

    def attach(self) -> None:
        tr = self.trainer
        step, update = tr.step, tr._update

        def timed_step(*args, **kwargs):
            self._cur = cur = dict.fromkeys(PHASES, 0.0) | {"overlapped_s": 0.0}
            t0, w0 = time.perf_counter(), recorder().wait_s
            try:
                return step(*args, **kwargs)
            finally:
                cur["step_s"] = time.perf_counter() - t0
                cur["comm_wait"] = recorder().wait_s - w0
                cur["bookkeeping"] = cur["step_s"] - sum(cur[k] for k in PHASES if k != "bookkeeping")
                self.steps.append(cur)
                self._cur = None

        def timed_update(*args, **kwargs):
            t0, w0 = time.perf_counter(), recorder().wait_s
            try:
                return update(*args, **kwargs)
            finally:
                self._add("optimizer", time.perf_counter() - t0 - (recorder().wait_s - w0))

        tr.step, tr._update = timed_step, timed_update
        tr.pipeline.runtime.observers.append(self)

    def detach(self) -> None:
        tr = self.trainer
        for name in ("step", "_update"):
            tr.__dict__.pop(name, None)
        tr.pipeline.runtime.observers[:] = [o for o in tr.pipeline.runtime.observers if o is not self]

    def _add(self, phase: str, seconds: float) -> None:
        if self._cur is not None:
            self._cur[phase] += seconds

    def _settle_pair(self) -> None:
        """B of an overlapped pair that outlived its F: the main thread waited for it (backward)."""
        with self._lock:
            if self._thread_end is not None and self._main_end is not None:
                self._add("backward", max(0.0, self._thread_end - self._main_end))
            self._thread_end = None

    def on_wait(self, a) -> None:
        if threading.current_thread() is threading.main_thread():
            self._settle_pair()

    def on_action_start(self, a) -> None:
        if threading.current_thread() is threading.main_thread():
            self._t_action, self._w_action = time.perf_counter(), recorder().wait_s
        else:
            a_start = time.perf_counter()
            with self._lock:
                self._thread_start = a_start

    def on_action_end(self, a) -> None:
        t = time.perf_counter()
        if threading.current_thread() is not threading.main_thread():
            with self._lock:
                self._thread_end = t
                self._add("overlapped_s", t - self._thread_start)
            return
        self._main_end = t
        phase = "forward" if a.kind == "F" else "backward"
        self._add(phase, t - self._t_action - (recorder().wait_s - self._w_action))

    def on_step_end(self) -> None:
        self._settle_pair()

    def report(self) -> dict:
        """``{"steps": [...], "mean": {...}}``: per-step phases and their means (seconds)."""
        keys = ("step_s", *PHASES, "overlapped_s")
        n = max(len(self.steps), 1)
        return {"phases": list(PHASES), "steps": self.steps,
                "mean": {k: sum(s[k] for s in self.steps) / n for k in keys}}
