"""Bad steps: skip a non-finite step on every rank, detect loss spikes, decide when to roll back.

Four parts, used by ``ndtrain.train.trainer`` (the skip) and ``ndtrain.train.loop`` (the rollback):

* ``agree_bad_ranks``: one all-reduce over the whole world of a (world,) flag vector, each rank
  setting its own slot when its local loss or gradient norm is not finite. Every rank learns the
  same list of bad ranks, so all of them skip the optimizer step together (a rank-local fault --
  a flipped bit, a bad kernel on one GPU -- would otherwise desynchronise the replicas).
  ``agree_bad_ranks_and_sum`` does the same and sums the step's loss in the same all-reduce (plain
  data parallel, where the loss group is the world: one blocking collective per step, not two).
* ``BadStepGuard``: counts consecutive bad steps (``training.max_bad_steps``) and keeps a window of
  ``training.spike_window`` good losses; a loss whose z-score against that window exceeds
  ``training.spike_zscore`` is a spike. Either asks for a rollback. The loss it sees is the
  global loss, identical on every rank after the loss all-reduce, so every rank decides alike
  without another collective.
* ``after_step``: logs ``bad_step`` / ``loss_spike`` events (rank 0) and calls the rollback.
* ``rollback``: reloads the newest verified checkpoint through ``Restorable``, the two methods the
  running job declares (``ndtrain.train.loop`` implements them).

A skipped step leaves weights, optimizer state and the LR schedule position bitwise unchanged; the
step counter and the data window still advance, so the batch that produced the non-finite value
is skipped, not retried. A rollback reloads the newest complete checkpoint but keeps the sampler
where it is: every batch since that checkpoint (including the one that caused the rollback) is
skipped. This is the recipe of PaLM (Chowdhery et al. 2022, section 5.1: restart about 100 steps
before the spike and skip the batches around it); OPT (Zhang et al. 2022) likewise restarted from
the last checkpoint after divergence.
"""
from __future__ import annotations

import collections
import math
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from ndtrain.events import log_event
from ndtrain.mesh import AxisGroup, Mesh
from ndtrain.parallel import comm


def world_group(mesh: Mesh) -> AxisGroup:
    """The whole world as an ``AxisGroup`` named "world" (size 1 without a process group)."""
    ws = mesh.dims.world_size
    if ws == 1 or not dist.is_initialized():
        return AxisGroup("world", 1, 0, None, mesh.stats)
    return AxisGroup("world", ws, dist.get_rank(), dist.group.WORLD, mesh.stats)


def agree_bad_ranks(local_bad: bool, group: AxisGroup, device: torch.device) -> list[int]:
    """Ranks (of ``group``) whose step was bad; the same list on every rank. One all-reduce of
    ``group.size`` floats."""
    flags = torch.zeros(group.size, dtype=torch.float32, device=device)
    flags[group.rank] = float(local_bad)
    comm.all_reduce(flags, group)
    return [i for i, f in enumerate(flags.tolist()) if f > 0]


def agree_bad_ranks_and_sum(local_bad: bool, value: torch.Tensor, group: AxisGroup,
                            device: torch.device) -> tuple[list[int], torch.Tensor]:
    """``agree_bad_ranks`` and the sum of the 0-d ``value`` over ``group``, in the same all-reduce
    of ``group.size + 1`` float64s (a data-parallel step's loss sum rides along with the bad-step
    flags instead of costing a second blocking collective). Returns (bad ranks, summed value as
    a 0-d float64 tensor); the same on every rank."""
    buf = torch.zeros(group.size + 1, dtype=torch.float64, device=device)
    buf[group.rank] = float(local_bad)
    buf[-1] = value.detach().to(torch.float64)
    comm.all_reduce(buf, group)
    flags = buf[:-1].tolist()
    return [i for i, f in enumerate(flags) if f > 0], buf[-1]


def is_finite(x) -> bool:
    return math.isfinite(float(x))


def inject_faults(trainer, loss_sum: torch.Tensor) -> torch.Tensor:
    """The trainer's test hooks, each step listed fires once (a step redone after a rollback is
    clean, like a transient fault). ``trainer.nan_steps``: poison this rank's local loss and one
    gradient element with NaN, after the gradient sync so no other rank sees it.
    ``trainer.spike_steps``: this rank's loss sum x 100 (what the spike detector sees; the
    gradients, already applied-to or not, are untouched). Returns the loss sum to report."""
    step = trainer.step_count + 1
    if step in trainer.nan_steps:
        trainer.nan_steps = trainer.nan_steps - {step}
        loss_sum.fill_(float("nan"))
        grads = [p.grad for g in trainer.optimizer.param_groups for p in g["params"] if p.grad is not None]
        grads[0].view(-1)[0] = float("nan")
    if step in trainer.spike_steps:
        trainer.spike_steps = trainer.spike_steps - {step}
        loss_sum = loss_sum * 100.0
    return loss_sum


class BadStepGuard:
    """Consecutive-bad-step counter and loss-spike detector (see the module docstring).

    Args:
        max_bad_steps: consecutive bad steps that trigger a rollback (0 = never roll back).
        spike_zscore: z-score threshold, (loss - mean) / std over the window (0 = off).
        spike_window: good losses kept; no spike is called before the window is full.
    """

    def __init__(self, max_bad_steps: int, spike_zscore: float, spike_window: int):
        self.max_bad_steps, self.spike_zscore = max_bad_steps, spike_zscore
        self.history: collections.deque = collections.deque(maxlen=max(spike_window, 2))
        self.consecutive_bad = 0

    def zscore(self, loss: float) -> tuple[float, float, float]:
        """(z, mean, std) of ``loss`` against the window (z = 0 when the window is not full or flat)."""
        n = len(self.history)
        if n < self.history.maxlen:
            return 0.0, float("nan"), float("nan")
        mean = sum(self.history) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in self.history) / (n - 1))
        return ((loss - mean) / std if std > 0 else 0.0), mean, std

    def observe(self, bad: bool, loss: float) -> tuple[str | None, dict]:
        """Feed one step; returns (None | "bad_steps" | "loss_spike", details)."""
        if bad:
            self.consecutive_bad += 1
            if self.max_bad_steps and self.consecutive_bad >= self.max_bad_steps:
                return "bad_steps", {"consecutive_bad_steps": self.consecutive_bad}
            return None, {}
        self.consecutive_bad = 0
        if self.spike_zscore > 0:
            z, mean, std = self.zscore(loss)
            if z > self.spike_zscore:
                return "loss_spike", {"zscore": z, "mean": mean, "std": std}
        self.history.append(loss)
        return None, {}

    def reset(self) -> None:
        """After a rollback: the window restarts (its losses belong to steps being redone)."""
        self.history.clear()
        self.consecutive_bad = 0


def after_step(guard: BadStepGuard, step: int, out: dict, run_dir: Path, rank: int,
               rollback: Callable[[str], dict]) -> bool:
    """Log this step's bad-step / spike events (rank 0) and roll back when the guard asks.

    ``rollback(reason)`` reloads the last good checkpoint (``rollback`` below) and returns the
    ``rollback`` event's fields; it raises RuntimeError when there is none. Returns True when the
    run was rolled back (the caller then skips logging / saving this step)."""
    bad = bool(out.get("bad_step"))
    if bad and rank == 0:
        log_event(run_dir, "bad_step", step=step, ranks=out.get("bad_ranks", []), loss=out.get("loss"),
                  grad_norm=out.get("grad_norm"))
    decision, details = guard.observe(bad, out.get("loss", float("nan")))
    if decision is None:
        return False
    if decision == "loss_spike" and rank == 0:
        log_event(run_dir, "loss_spike", step=step, loss=out["loss"], **details)
    fields = rollback(decision)
    guard.reset()
    if rank == 0:
        log_event(run_dir, "rollback", step=step, reason=decision, **details, **fields)
        print(f"step {step}: {decision} -> rolled back to step {fields['to_step']} "
              f"({fields['checkpoint']}), skipping sequences {fields['skipped_stream']}", flush=True)
    return True


class Restorable(Protocol):
    """What a rollback needs of the running job (``ndtrain.train.loop`` implements it)."""

    def last_good_checkpoint(self) -> tuple[Path | None, Path]:
        """(the newest checkpoint that verifies, or None; the folder searched), once any save in
        flight is complete. Collective."""

    def restore(self, path: Path) -> tuple[int, tuple[int, int]]:
        """Load ``path`` into the running trainer (weights, optimizer, schedule, step) but keep
        the data position; returns (the restored step, (the checkpoint's data position, the kept
        one)): the sampler stream positions skipped. Collective."""


def rollback(run: Restorable, reason: str, step: int) -> dict:
    """Reload the newest verified checkpoint into the running job at ``step`` (collective), the
    sampler staying where it is, so every batch since that checkpoint is skipped. Returns the
    ``rollback`` event's fields: ``to_step``, ``checkpoint``, ``skipped_stream`` ([first, end)
    sampler stream positions skipped).

    Raises RuntimeError when the run directory holds no checkpoint to roll back to."""
    path, root = run.last_good_checkpoint()
    if path is None:
        raise RuntimeError(f"{reason} at step {step}: no checkpoint in {root} to "
                           "roll back to (set checkpoint.every, or raise training.max_bad_steps)")
    to_step, (first, end) = run.restore(path)
    return {"to_step": to_step, "checkpoint": str(path), "skipped_stream": [first, end]}
