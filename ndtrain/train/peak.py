"""Peak FLOP/s per device, the denominator of MFU: datasheet, override, or measured on CPU.

Datasheet peaks are the planner's table (``ndtrain.planner.accelerators.HARDWARE``: dense, no
sparsity; fp8 with ``training.fp8``); a torch device name finds its row through
``ndtrain.planner.hardware.device_accelerator``. On CPU the peak is a short matmul benchmark at
start-up for the run's dtype, cached per CPU model / thread count (``$NDTRAIN_CACHE``, default
``~/.cache/ndtrain/cpu_peak_flops.json``) and kept at the best reading across runs. A reading that
is implausible (under half the cached best, or a first one on a busy machine; later, an MFU above
``CPU_MFU_CEILING``) is measured once more, and flagged "measured under load" in ``peak_basis``
(the ``mfu_peak`` of metrics rows and the start-up summary) when it stays suspect.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from pathlib import Path

import torch

from ndtrain.planner.accelerators import HARDWARE
from ndtrain.planner.hardware import device_accelerator

# The column of the datasheet table a run's dtype is measured against, where it is not the dtype's
# own: fp32 runs against the TF32 tensor-core peak, the ceiling of an fp32 matmul with TF32 on
# (with torch's default, TF32 off, the FP32 column is lower, so fp32 MFU reads conservatively).
_PEAK_COLUMN = {"float32": "tf32"}


class UnknownPeak(ValueError):
    """The accelerator is not in the table; MFU is reported as unknown rather than wrong."""


def gpu_peak_flops(name: str, dtype: str, fp8: bool = False) -> float:
    """Datasheet peak FLOP/s of a GPU by device name (e.g. "NVIDIA H100 80GB HBM3") for ``dtype``,
    or its fp8 peak with ``fp8`` (``HARDWARE``, via ``device_accelerator``); raises UnknownPeak."""
    key = device_accelerator(name)
    column = "float8" if fp8 else _PEAK_COLUMN.get(dtype, dtype)
    if key is None or column not in HARDWARE[key].peak_flops_per_s:
        raise UnknownPeak(f"unknown {'fp8 ' if fp8 else ''}peak FLOP/s for {name!r}; set logging.peak_flops_per_s")
    return HARDWARE[key].peak_flops_per_s[column]


def peak_basis(device: torch.device, dtype: str, override: float = 0.0, fp8: bool = False) -> str:
    """Which peak ``peak_flops`` returns, in words (the ``mfu_peak`` field of metrics rows):
    "override", "<GPU> <fp8|dtype> datasheet", "cpu <dtype> measured" (+ " under load" when this
    process's reading is flagged, ``CpuPeak.under_load``), or "unknown"."""
    if override > 0:
        return "override"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        try:
            gpu_peak_flops(name, dtype, fp8)
        except UnknownPeak:
            return "unknown"
        return f"{device_accelerator(name)} {'fp8' if fp8 else dtype} datasheet"
    loaded = any(r is not None and r.under_load for r in map(_reading, _cpu_dtypes(dtype)))
    what = "best of bfloat16 / float32" if dtype == "float16" else dtype
    return f"cpu {what} measured{' under load' if loaded else ''}"


# A fresh CPU reading under this share of the cached best: the machine is busier now than then.
LOW_READING = 0.5
# No training step on CPU runs its matmuls near the bare-matmul peak (norms, softmax, optimizer and
# data movement share the step); an MFU above this means the peak was measured low, under load.
CPU_MFU_CEILING = 0.8


@dataclasses.dataclass
class CpuPeak:
    """One CPU matmul-peak reading of this process (FLOP/s): ``value`` = max(``fresh``, ``cached``),
    ``fresh`` this process's best window, ``cached`` the best earlier one on disk (0: none);
    ``remeasured``: the first reading was implausible and was taken again; ``under_load``: the
    value is suspect (first reading on a busy machine, or an MFU still above the ceiling)."""

    value: float
    fresh: float
    cached: float
    remeasured: bool = False
    under_load: bool = False


_READINGS: dict[tuple[str, int, int], CpuPeak] = {}  # (dtype, threads, n) -> this process's reading
_RECHECKED: set[str] = set()  # dtypes whose peak an implausible MFU already made measure again


def _cache_dir() -> Path:
    return Path(os.environ.get("NDTRAIN_CACHE", Path.home() / ".cache" / "ndtrain"))


def _matmul_rate(dtype: str, n: int, seconds: float) -> float:
    """Best FLOP/s of (n x n) @ (n x n) matmuls in ``dtype`` over short windows for ``seconds``."""
    dt = getattr(torch, dtype)
    a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
    a @ b
    best, t_end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        for _ in range(2):
            a @ b
        best = max(best, 2 * 2 * n**3 / (time.perf_counter() - t0))
    return best


def machine_busy() -> bool:
    """More runnable processes than cores over the last minute (1-min load average; False where
    the load average is unavailable)."""
    try:
        return os.getloadavg()[0] > (os.cpu_count() or 1)
    except (AttributeError, OSError):
        return False


def cpu_peak(dtype: str, n: int = 1024, seconds: float = 0.4, measure=None, busy=None,
             again: bool = False) -> CpuPeak:
    """This process's CPU matmul peak for ``dtype``: the best of its measurement and every earlier
    one on this CPU / thread count (cached on disk, ``$NDTRAIN_CACHE/cpu_peak_flops.json``).

    ``measure()`` returns FLOP/s (default: the best window of ``_matmul_rate``, about ``seconds``);
    ``busy()`` says whether the machine is loaded (default ``machine_busy``). Keeping the maximum
    across runs matters on a shared machine: a peak measured while other processes compete is too
    low and inflates MFU. A fresh reading under ``LOW_READING`` of the cached best, or a first one
    (nothing cached) on a busy machine, is measured once more; a first reading whose machine is
    still busy is flagged ``under_load``. One reading per process unless ``again``.
    """
    threads = torch.get_num_threads()
    if (dtype, threads, n) in _READINGS and not again:
        return _READINGS[(dtype, threads, n)]
    measure = measure or (lambda: _matmul_rate(dtype, n, seconds))
    busy = busy or machine_busy
    key = f"{platform.processor() or platform.machine()}-{threads}t-{dtype}-{n}-torch{torch.__version__}"
    path = _cache_dir() / "cpu_peak_flops.json"
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    cached, fresh = cache.get(key, 0.0), measure()
    retry = fresh < LOW_READING * cached if cached else busy()
    if retry:
        fresh = max(fresh, measure())
    reading = CpuPeak(max(fresh, cached), fresh, cached, retry, under_load=not cached and retry and busy())
    cache[key] = reading.value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass
    _READINGS[(dtype, threads, n)] = reading
    return reading


def _reading(dtype: str) -> CpuPeak | None:
    """This process's reading for ``dtype`` at its thread count (the one ``peak_flops`` used)."""
    return _READINGS.get((dtype, torch.get_num_threads(), 1024))


def cpu_peak_flops(dtype: str, n: int = 1024, seconds: float = 0.4) -> float:
    """``cpu_peak(dtype, n, seconds).value``: matmul FLOP/s of this process on CPU."""
    return cpu_peak(dtype, n, seconds).value


def _cpu_dtypes(dtype: str) -> tuple[str, ...]:
    # CPUs without native fp16 matmul run a plain fp16 matmul on a slow path (about 1 GFLOP/s
    # here), while fp16 autocast kernels do far better; the honest ceiling is the best of the
    # native paths, so MFU can never read above 100%.
    return ("bfloat16", "float32") if dtype == "float16" else (dtype,)


def peak_flops(device: torch.device, dtype: str, override: float = 0.0, fp8: bool = False) -> float | None:
    """Peak FLOP/s of one device: override, datasheet table (the fp8 peak with ``fp8``), or CPU
    benchmark; None if unknown. ``peak_basis`` names which."""
    if override > 0:
        return override
    if device.type == "cuda":
        try:
            return gpu_peak_flops(torch.cuda.get_device_name(device), dtype, fp8)
        except UnknownPeak:
            return None
    return max(cpu_peak_flops(k) for k in _cpu_dtypes(dtype))


def recheck_cpu_peak(row: dict, peak: float | None, basis: str, device: torch.device, dtype: str,
                     measure=None, busy=None) -> tuple[float | None, str]:
    """Vet a metrics row's MFU against its peak and set ``row["mfu_peak"]``; returns the (peak,
    basis) for this and later rows.

    On CPU with a measured peak, an ``mfu`` above ``CPU_MFU_CEILING`` means the peak was measured
    low (on a loaded machine): it is measured again, once per process (``measure`` / ``busy`` as
    for ``cpu_peak``; the disk cache keeps the best), and the row's ``mfu`` / ``hfu`` are rescaled
    to the new peak; if the row still reads above the ceiling, or the re-measurement found no
    better peak than a flagged start-up one, the basis says "... measured under load".
    """
    mfu = row.get("mfu")
    if device.type != "cpu" or not peak or "measured" not in basis or mfu is None or mfu <= CPU_MFU_CEILING:
        row["mfu_peak"] = basis
        return peak, basis
    if dtype not in _RECHECKED:
        _RECHECKED.add(dtype)
        before = [_reading(k) for k in _cpu_dtypes(dtype)]
        new = max(peak, *(cpu_peak(k, measure=measure, busy=busy, again=True).value for k in _cpu_dtypes(dtype)))
        row["mfu"] = mfu * peak / new
        if row.get("hfu") is not None:
            row["hfu"] = row["hfu"] * peak / new
        stale = any(r is not None and r.under_load for r in before) and new == peak
        for k in _cpu_dtypes(dtype):
            _reading(k).under_load = row["mfu"] > CPU_MFU_CEILING or stale
        peak, basis = new, peak_basis(device, dtype)
    row["mfu_peak"] = basis
    return peak, basis
