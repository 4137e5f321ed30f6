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
"""

from __future__ import annotations

from pathlib import Path

from ndtrain.config.validate import parse_profile_steps

DEFAULT_WINDOW = "2:3"  # step 1 pays allocation and warm-up; two steady steps show the pattern


def trace_path(run_dir: Path, window: tuple[int, int], rank: int) -> Path:
    """Where rank ``rank`` writes the trace of ``window``."""
    return Path(run_dir) / "profile" / f"trace_steps_{window[0]}-{window[1]}_rank_{rank}.json"


class StepProfiler:
    """Starts ``torch.profiler`` before step A and writes the trace after step B (module docstring).

    Use: ``begin(step)`` before each step's work, ``end(step)`` after it, ``close()`` after the loop.
    Inactive (every call a no-op) when ``spec`` is empty."""

    def __init__(self, spec: str, run_dir: Path, rank: int, device_type: str):
        self.window = parse_profile_steps(spec)
        self.run_dir, self.rank, self.device_type = Path(run_dir), rank, device_type
        self.prof = None
        self._range = None
        self.path: Path | None = None

    def begin(self, step: int) -> None:
        if self.window is None or not self.window[0] <= step <= self.window[1]:
            return
        import torch
        from torch.profiler import ProfilerActivity, profile

        if self.prof is None:
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device_type == "cuda" else [])
            self.prof = profile(activities=acts, record_shapes=True)
            self.prof.__enter__()
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
