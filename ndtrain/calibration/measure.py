"""Measure this machine: matmul peak FLOP/s and collective alpha / beta (``ndtrain plan --measure``).

* Matmul: times square (n x n) @ (n x n) products of a few sizes for a fraction of a second each
  (CUDA events on GPU, wall clock on CPU); the best rate is this machine's achievable peak, the
  analogue of the lecture's "simple matmul loop" benchmark (HFU ~80% of the datasheet on H100).
* Collectives: spawns ``world`` processes with ``ndtrain.spawn`` (gloo on 127.0.0.1 on CPU,
  NCCL on GPU), times all-reduce of several sizes (best of a few repetitions after a warm-up), and
  fits the ring model t = 2(n-1) alpha + 2(n-1)/n * V / beta by least squares (``fit_alpha_beta``).

The results replace the ``cpu`` table entry's placeholders (``measured_accelerator``) so plans for
this machine use measured numbers. Only this module imports torch; the rest of the planner does not.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import replace

from ndtrain.planner.hardware import Accelerator, get_accelerator


def measure_matmul_flops(sizes=(256, 512, 1024), dtype: str = "float32", seconds: float = 0.2,
                         device: str = "auto") -> dict:
    """FLOP/s of (n x n) @ (n x n) for each n; returns {"per_size": {n: FLOP/s}, "peak": max}."""
    import torch

    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    dt = getattr(torch, dtype)
    per = {}
    for n in sizes:
        a, b = torch.randn(n, n, device=dev, dtype=dt), torch.randn(n, n, device=dev, dtype=dt)
        for _ in range(2):
            a @ b
        _sync(dev)
        iters, t0 = 0, time.perf_counter()
        while True:
            a @ b
            iters += 1
            if iters % 4 == 0:
                _sync(dev)
                if time.perf_counter() - t0 >= seconds:
                    break
        per[n] = 2.0 * n**3 * iters / (time.perf_counter() - t0)
    return {"per_size": per, "peak": max(per.values()), "dtype": dtype, "device": dev.type}


def _sync(dev) -> None:
    if dev.type == "cuda":
        import torch

        torch.cuda.synchronize(dev)


def fit_alpha_beta(samples: list, n: int) -> tuple[float, float]:
    """Least-squares fit of ring all-reduce times: samples [(bytes, seconds)], n ranks.

    Returns (alpha seconds per step, beta bytes/s per direction). Raises ValueError for fewer than
    two distinct sizes. alpha is clamped at 0 (noise can make the intercept slightly negative).
    """
    xs = [float(v) for v, _ in samples]
    ys = [float(t) for _, t in samples]
    if len(set(xs)) < 2:
        raise ValueError("fit_alpha_beta needs at least two message sizes")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    intercept = my - slope * mx
    alpha = max(0.0, intercept) / (2 * (n - 1))
    if slope <= 0:
        raise ValueError("all-reduce times do not grow with message size (noisy machine?); "
                         "measure again or with larger sizes")
    return alpha, 2 * (n - 1) / n / slope


def _collective_worker(rank, world, sizes, reps, backend):
    import torch
    import torch.distributed as dist

    dev = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # the closing barrier runs on this rank's GPU
    out = []
    for nbytes in sizes:
        x = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=dev)
        for _ in range(3):  # warm-up: connections, buffers, caches
            dist.all_reduce(x)
        times = []
        for _ in range(reps):
            _sync(dev)
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            _sync(dev)
            times.append(time.perf_counter() - t0)
        out.append((x.numel() * 4, min(times)))  # the least disturbed repetition
    return out


def measure_collectives(world: int = 2, sizes=(2**12, 2**16, 2**20, 2**22), reps: int = 5,
                        backend: str = "auto", timeout_s: float = 120.0) -> dict:
    """Time all-reduce over ``world`` local processes; returns samples and the fitted alpha, beta.

    A measurement whose times do not grow with size (a noisy, shared machine) is repeated, up to
    three times, rather than reporting an infinite bandwidth. Raises RuntimeError if a worker fails,
    the measurement times out, or no attempt gives a usable fit.
    """
    for _attempt in range(3):
        samples, backend = _time_all_reduce(world, sizes, reps, backend, timeout_s)
        try:
            alpha, beta = fit_alpha_beta(samples, world)
        except ValueError:
            continue
        return {"backend": backend, "world": world, "samples": samples, "alpha_s": alpha,
                "beta_bytes_per_s": beta}
    raise RuntimeError(f"all-reduce timings never grew with message size: {samples}")


def _time_all_reduce(world: int, sizes, reps: int, backend: str, timeout_s: float):
    import torch

    from ndtrain.spawn import spawn

    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"
    # one thread per rank: the ranks share this machine's cores, as the ranks of a run do
    per_rank = spawn(_collective_worker, world, (list(sizes), reps, backend), backend=backend, threads=1,
                     timeout_s=timeout_s)
    return per_rank[0], backend


def _sync_worker(rank, world, nbytes, work_n, iters, reps, gap_s=None):
    import torch
    import torch.distributed as dist

    a, b = torch.randn(work_n, work_n), torch.randn(work_n, work_n)
    x = torch.ones(max(1, nbytes // 4))
    if gap_s:
        return _timed_waits(a, b, x, gap_s, iters * reps)

    def loop(collective: bool) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            a @ b  # the rank's compute between two blocking collectives
            if collective:
                dist.all_reduce(x)
        return time.perf_counter() - t0

    loop(True)  # warm-up: connections, buffers
    extra = [loop(True) - loop(False) for _ in range(reps)]  # interleaved: load drifts hit both
    return statistics.median(extra) / iters


def _timed_waits(a, b, x, gap_s: float, iters: int) -> tuple[float, float]:
    """(median seconds inside one blocking all-reduce of ``x``, mean compute between two, mean
    seconds inside one all-reduce) over
    ``iters`` iterations of ``gap_s`` seconds of ``a @ b`` (rank 0's count on every rank) then the
    all-reduce: the split ``ndtrain train`` logs as a rank's busy and collective-wait time."""
    import torch
    import torch.distributed as dist

    one = []
    for _ in range(7):  # the median matmul: a preempted one would shorten the gap
        t0 = time.perf_counter()
        a @ b
        one.append(time.perf_counter() - t0)
    k = torch.tensor([max(1, round(gap_s / statistics.median(one)))], dtype=torch.float64)
    dist.broadcast(k, 0)
    k = int(k.item())
    for _ in range(3):  # warm-up: connections, buffers
        dist.all_reduce(x)
    dist.barrier()
    work, waits = 0.0, []
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(k):
            a @ b
        t1 = time.perf_counter()
        dist.all_reduce(x)
        work += t1 - t0
        waits.append(time.perf_counter() - t1)
    return statistics.median(waits), work / iters, statistics.fmean(waits)


def measure_sync_latency(world: int = 2, nbytes: int = 4096, work_n: int = 384, iters: int = 50,
                         reps: int = 5, timeout_s: float = 120.0, gap_s: float | None = None) -> dict:
    """Seconds one blocking gloo all-reduce costs ranks that compute between collectives, as a
    training step's ranks do (one thread each). Two forms:

    * ``gap_s`` None: ``world`` processes run ``iters`` x (a ``work_n``-square matmul, about a
      millisecond here, then an all-reduce of ``nbytes``) and the same loop without the
      all-reduce; the difference per iteration (median over ``reps`` interleaved pairs, max over
      ranks) is ``per_collective_s``.
    * ``gap_s``: the ranks compute ``gap_s`` seconds of matmuls (rank 0's count on every rank)
      between all-reduces, ``iters`` x ``reps`` times (at most ~1.5 s in all), and time each
      all-reduce from its call to its return: ``per_collective_s`` is the median wait (mean over
      ranks; the median because a burst of other jobs in this ~1.5 s window would otherwise
      stand for a whole run; ``mean_wait_s`` is kept too), ``gap_measured_s`` the mean compute
      between two; the same split as the busy and
      wait times ``ndtrain train`` logs per rank (its flight recorder times each wait), and,
      measured in one loop, far less noisy on a loaded machine than a difference of two loops.

    Either is more than the idle all-reduce time of ``measure_collectives``: a rank blocks until
    the slowest peer arrives (the ranks' compute jitters on shared cores, the more the longer it
    runs), then sleeps and is woken by gloo's threads. ``alpha_s`` is the cost per ring step
    (``per_collective_s / (2 (world - 1))``, as ``fit_alpha_beta``), the latency the eager
    step-time models charge per blocking collective (``planner.eager_axes_time``); with ``nbytes``
    and ``gap_s`` of a layout's own collectives (``eager_axes_time.axis_collective_gap``)
    ``per_collective_s`` is that layout's measured cost per collective, transfer included.
    Raises RuntimeError if a worker fails or times out."""
    from ndtrain.spawn import spawn

    if gap_s is not None:
        iters, reps = max(10, min(iters * reps, round(1.5 / max(gap_s, 1e-4)))), 1
    per_rank = spawn(_sync_worker, world, (nbytes, work_n, iters, reps, gap_s), backend="gloo", threads=1,
                     timeout_s=timeout_s)
    if gap_s is None:
        per = max(0.0, max(per_rank))
    else:
        per = statistics.fmean(r[0] for r in per_rank)
    out = {"world": world, "nbytes": nbytes, "work_n": work_n, "per_collective_s": per,
           "alpha_s": per / (2 * (world - 1))}
    if gap_s is not None:
        out.update(gap_s=gap_s, gap_measured_s=statistics.fmean(r[1] for r in per_rank), iters=iters,
                   mean_wait_s=statistics.fmean(r[2] for r in per_rank))
    return out


def measured_accelerator(matmul: dict, comm: dict | None = None, base: str = "cpu") -> Accelerator:
    """The ``base`` table entry with the measured peak (for the measured dtype) and, if given, the
    measured collective alpha / beta as its intra-node link."""
    acc = get_accelerator(base)
    flops = dict(acc.peak_flops_per_s)
    flops[matmul["dtype"]] = matmul["peak"]
    acc = replace(acc, peak_flops_per_s=flops, source=f"measured on this machine ({matmul['device']})")
    if comm:
        acc = replace(acc, intra_node_bytes_per_s=comm["beta_bytes_per_s"],
                      intra_node_latency_s=comm["alpha_s"])
    return acc


def format_measurements(matmul: dict, comm: dict | None) -> str:
    lines = [f"matmul ({matmul['device']}, {matmul['dtype']}): "
             + ", ".join(f"n={n}: {f / 1e9:.1f} GFLOP/s" for n, f in matmul["per_size"].items())
             + f"; peak {matmul['peak'] / 1e9:.1f} GFLOP/s"]
    if comm:
        lines.append(f"all-reduce ({comm['backend']}, {comm['world']} ranks): "
                     + ", ".join(f"{v / 2**10:.0f} KiB: {t * 1e3:.2f} ms" for v, t in comm["samples"]))
        lines.append(f"fit: alpha = {comm['alpha_s'] * 1e6:.1f} us, "
                     f"beta = {comm['beta_bytes_per_s'] / 1e9:.2f} GB/s")
    return "\n".join(lines)
