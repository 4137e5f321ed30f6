"""Training time with failures: checkpoint interval, expected interruptions and lost time.

A job of N GPUs fails at rate N / MTTF_gpu (independent failures, exponential inter-arrival), so
its mean time to interruption is M = MTTF_gpu / N. It saves a checkpoint of ``save_s`` every
``interval_s`` of work and, after each interruption, loses the work since the last save, pays
the restart (scheduler, process start, NCCL setup) and the checkpoint load. The interval is Young's
optimum tau = sqrt(2 * save_s * M) (Young 1974); the expected wall-clock time of W seconds of work
is Daly's first-order-complete model (Daly 2006, eq. 20):

    T_wall = M * exp(R / M) * (exp((tau + save_s) / M) - 1) * W / tau,   R = restart_s + load_s

Defaults: ``MTTF_GPU_HOURS`` is Llama 3 405B's pre-training record ("The Llama 3 Herd of Models",
2024, section 3.3.4: 466 job interruptions in a 54-day snapshot on 16,384 H100), i.e. one every
2.78 hours of that job; the save / load time is the rank's checkpoint bytes (weights and
optimizer state, each rank writing its own shard) at ``CHECKPOINT_BYTES_PER_S`` per GPU; the
restart ``RESTART_S``. Units: seconds, hours where named, bytes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

LLAMA3_INTERRUPTIONS, LLAMA3_DAYS, LLAMA3_GPUS = 466, 54, 16384
MTTF_GPU_HOURS = LLAMA3_DAYS * 24 * LLAMA3_GPUS / LLAMA3_INTERRUPTIONS  # ~45,600 h per GPU
CHECKPOINT_BYTES_PER_S = 2e9  # assumed: per-GPU share of a parallel file system's write / read rate
RESTART_S = 600.0  # assumed: requeue, process start, NCCL communicator setup, data-loader warm-up


@dataclass(frozen=True)
class Goodput:
    """The failure model of one run (seconds; ``interruptions`` expected over the run)."""

    job_mttf_s: float
    save_s: float
    load_s: float
    restart_s: float
    interval_s: float
    wall_s: float  # expected wall-clock seconds including saves, lost work and restarts
    work_s: float  # failure-free seconds
    interruptions: float

    @property
    def efficiency(self) -> float:
        """Failure-free time / expected time (the goodput share)."""
        return self.work_s / self.wall_s if self.wall_s else 1.0

    def to_dict(self) -> dict:
        return {"job_mttf_hours": self.job_mttf_s / 3600, "checkpoint_save_s": self.save_s,
                "checkpoint_load_s": self.load_s, "restart_s": self.restart_s,
                "checkpoint_interval_s": self.interval_s, "interruptions": self.interruptions,
                "goodput": self.efficiency}


class NeverFinishes(ValueError):
    """The failure rate outpaces every checkpoint interval: the expected time is unbounded."""


def young_interval(save_s: float, job_mttf_s: float) -> float:
    """Young's checkpoint interval sqrt(2 * save_s * M) (seconds of work between saves)."""
    return math.sqrt(2.0 * save_s * job_mttf_s)


def daly_wall_time(work_s: float, interval_s: float, save_s: float, recover_s: float, job_mttf_s: float) -> float:
    """Daly's expected wall-clock seconds for ``work_s`` of work (module docstring); raises
    ValueError for a non-positive interval or MTTF."""
    if interval_s <= 0 or job_mttf_s <= 0:
        raise ValueError(f"checkpoint interval ({interval_s}) and MTTF ({job_mttf_s}) must be positive")
    m = job_mttf_s
    if (recover_s + interval_s + save_s) / m > 700:  # exp would overflow: failures outpace all progress
        raise NeverFinishes(f"the job's MTTF ({m:.3g} s) is far below a checkpoint interval + save + restart "
                         f"({interval_s + save_s + recover_s:.3g} s): the run would never finish")
    return m * math.exp(recover_s / m) * math.expm1((interval_s + save_s) / m) * work_s / interval_s


def checkpoint_seconds(checkpoint_bytes: float, bytes_per_s: float = CHECKPOINT_BYTES_PER_S) -> float:
    """Save (or load) seconds of one rank's checkpoint shard: all ranks write in parallel."""
    return checkpoint_bytes / bytes_per_s


def goodput(work_s: float, gpus: int, checkpoint_bytes: float, mttf_gpu_hours: float = 0.0,
            save_s: float = 0.0, load_s: float = 0.0, restart_s: float = -1.0) -> Goodput:
    """The failure model of ``work_s`` failure-free seconds on ``gpus`` GPUs. 0 / negative
    arguments take the defaults (module docstring); ``checkpoint_bytes``: one rank's shard."""
    mttf = (mttf_gpu_hours or MTTF_GPU_HOURS) * 3600 / gpus
    save = save_s or checkpoint_seconds(checkpoint_bytes)
    load = load_s or checkpoint_seconds(checkpoint_bytes)
    restart = RESTART_S if restart_s < 0 else restart_s
    tau = young_interval(save, mttf)
    wall = daly_wall_time(work_s, tau, save, restart + load, mttf)
    return Goodput(mttf, save, load, restart, tau, wall, work_s, wall / mttf)
