"""The benchmark harness shared by ``bench/*.py``: timing, peak memory, machine facts, JSON.

* ``time_fn(fn, device)``: ``warmup`` untimed calls, then ``repeats`` timed calls; on CUDA each call
  is bracketed by CUDA events (``torch.cuda.Event(enable_timing=True)``) and the device is
  synchronised before reading them, on CPU ``time.perf_counter`` brackets the call. The result
  carries the median (the number to report: robust to a noisy neighbour on a shared machine), the
  minimum and every sample, in seconds. On CPU it also carries the median process CPU time per
  call over the torch threads: on a machine shared by more runnable processes than cores, a long
  call is descheduled for part of its wall time, and CPU time is what it took while running (it
  overstates the speed when the threads idle, e.g. waiting on memory; compare both).
* ``peak_bytes(fn, device)``: the rise of memory while ``fn`` runs. CUDA: ``max_memory_allocated``
  over what was allocated before (the allocator's own count). CPU: the peak of live storages that
  ``fn``'s operators create (``ndtrain.mem_account.ActivationMeter``), so the number does not depend
  on the C allocator's caching or on other processes.
* ``machine_info(device)``: CPU count, load average (1/5/15 min), torch / Triton versions, device
  name, threads, so every JSON result says how loaded the machine was when it was measured.
* ``write_result(path, result, device)``: the result plus ``machine`` and ``date`` as indented JSON.
* ``cpu_peak_estimate(dtype)``: this CPU's peak FLOP/s from its vector units (``/proc/cpuinfo``
  flags, nominal clock) next to the best matmul rate ``ndtrain.train.metrics.cpu_peak_flops`` measured.

Method after the lectures on benchmarking (warm up first: the first call pays compilation, caches and
page faults; synchronise: CUDA calls return before the kernel ends; report a median over repeats).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch


@dataclass
class Timing:
    """Seconds per call of a timed function: ``median_s`` (report this), ``min_s``, all samples;
    on CPU also ``cpu_median_s``, the median process CPU time per call divided by the torch
    threads (the on-core time: what the call took while the OS ran it, see module docstring)."""

    median_s: float
    min_s: float
    times_s: list[float] = field(default_factory=list)
    cpu_median_s: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def as_device(device) -> torch.device:
    """``device`` as a ``torch.device`` (None: CUDA when present, else CPU)."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def sync(device) -> None:
    """Wait for the device's queued work (a no-op on CPU, where calls are synchronous)."""
    if as_device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], device=None, warmup: int = 1, repeats: int = 5) -> Timing:
    """Time ``fn()``: ``warmup`` untimed calls, then ``repeats`` timed ones (see module docstring).

    Raises ValueError when ``repeats`` < 1."""
    if repeats < 1:
        raise ValueError(f"repeats ({repeats}) must be >= 1")
    dev = as_device(device)
    for _ in range(warmup):
        fn()
    sync(dev)
    times, cpu_times = [], []
    for _ in range(repeats):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)  # ms -> s
        else:
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            times.append(time.perf_counter() - t0)
            cpu_times.append((time.process_time() - c0) / torch.get_num_threads())
    cpu = statistics.median(cpu_times) if cpu_times else None
    return Timing(statistics.median(times), min(times), times, cpu)


def peak_bytes(fn: Callable[[], object], device=None) -> int:
    """Bytes by which memory rose at its peak while ``fn()`` ran (see module docstring).

    ``fn``'s return value is dropped inside the measurement, so what it returns counts only while
    it is alive during the call."""
    dev = as_device(device)
    if dev.type == "cuda":
        sync(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        fn()
        sync(dev)
        return int(torch.cuda.max_memory_allocated(dev) - before)
    from ndtrain.mem_account import ActivationMeter

    with ActivationMeter([]) as meter:
        fn()
    return int(meter.peak)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device=None) -> str:
    """The accelerator's name (``torch.cuda.get_device_name``) or the CPU model."""
    dev = as_device(device)
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else _cpu_model()


def machine_info(device=None) -> dict:
    """Facts that qualify a measurement: CPUs, load average, versions, device, threads."""
    dev = as_device(device)
    info = {
        "device": dev.type,
        "device_name": device_name(dev),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "torch_threads": torch.get_num_threads(),
        "load_avg_1_5_15": [round(x, 2) for x in os.getloadavg()],
        "torch": torch.__version__,
        "python": platform.python_version(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", "") == "1",
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if dev.type == "cuda":
        info["cuda"] = torch.version.cuda
    return info


def write_result(path: Path | str, result: dict, device=None) -> Path:
    """Write ``result`` with ``machine`` (``machine_info``) and ``date`` (UTC) as JSON; returns the
    path (parents created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    out = dict(result)
    out["machine"] = machine_info(device)
    out["date"] = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    path.write_text(json.dumps(out, indent=1) + "\n")
    return path


# FLOPs per cycle per core of one vector / matrix unit class, two FMA ports (Intel server cores):
# AVX-512: 16 fp32 lanes x 2 (FMA) x 2 ports; AVX2: 8 x 2 x 2; AMX (Sapphire Rapids TMUL): 1024
# bf16 FLOPs per cycle (Intel optimization manual, AMX chapter); fp64 half of fp32.
_FLOPS_PER_CYCLE = {
    "amx_bf16": {"bfloat16": 1024},
    "avx512f": {"float32": 64, "float64": 32, "bfloat16": 64},
    "avx2": {"float32": 32, "float64": 16, "bfloat16": 32},
}


def cpu_peak_estimate(dtype: str = "float32") -> dict:
    """This CPU's peak FLOP/s for ``dtype`` on the cores this process uses (``torch.get_num_threads()``,
    at most the CPU count): ``theoretical`` = cores x nominal clock x FLOPs per
    cycle of its best unit (``/proc/cpuinfo``: flags, ``cpu MHz``; None where unreadable),
    ``measured`` = the best matmul rate of ``ndtrain.train.metrics.cpu_peak_flops`` for one thread (cached
    across runs) times the cores, and ``peak`` = the larger, the ceiling plots use (a virtual CPU's
    nominal clock can be below its turbo clock, so the measurement can beat the estimate)."""
    from ndtrain.train.metrics import cpu_peak_flops

    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = set(next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []))
    mhz = next((float(ln.split(":", 1)[1]) for ln in text.splitlines() if ln.startswith("cpu MHz")), None)
    per_cycle = next(
        (
            _FLOPS_PER_CYCLE[u][dtype]
            for u in ("amx_bf16", "avx512f", "avx2")
            if u in flags and dtype in _FLOPS_PER_CYCLE[u]
        ),
        None,
    )
    cores = min(os.cpu_count() or 1, torch.get_num_threads())  # the cores this process may use
    theory = cores * mhz * 1e6 * per_cycle if mhz and per_cycle else None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        measured = cpu_peak_flops(dtype) * cores
    finally:
        torch.set_num_threads(threads)
    return {
        "dtype": dtype,
        "cores": cores,
        "nominal_mhz": mhz,
        "flops_per_cycle_per_core": per_cycle,
        "theoretical": theory,
        "measured": measured,
        "peak": max(theory or 0.0, measured),
    }
