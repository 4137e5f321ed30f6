"""Distributed checkpoints with ``torch.distributed.checkpoint`` (DCP): atomic, keep-last-k, resumable.

Layout: ``CKPT_ROOT/step_00000010/`` holds the DCP files of the tensor state (model, optimizer; each
rank writes its own shards, and DCP's planner de-duplicates replicated tensors), ``meta.json``
(step, LR scheduler, data sampler, layout; identical on all ranks) and ``rng_rank{r}.pt`` (each
rank's RNG states).

Atomicity: everything is written into ``step_XXXXXXXX.tmp``; after a barrier rank 0 renames it to
``step_XXXXXXXX``. A process killed mid-save leaves only a ``.tmp`` folder, which
``latest_checkpoint`` ignores (and the next save removes), so the previous checkpoint stays the
newest complete one. Old complete checkpoints beyond ``keep_last`` are deleted only after the
rename.

Resharding: DCP stores tensors by fully qualified name with their global shapes, so a checkpoint
saved under one layout loads into the state dict of another as long as each layout presents its
state under the same names and global shapes.
"""
from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

_STEP_DIR = re.compile(r"^step_(\d{8})$")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint folder under ``root`` (``.tmp`` folders are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return None
    done = sorted(p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name))
    return done[-1] if done else None


def save_checkpoint(root: Path, step: int, tensors: dict[str, Any], meta: dict[str, Any],
                    keep_last: int = 2) -> Path:
    """Collective: every rank calls it. Returns the final folder path.

    Args:
        tensors: state dict tree of tensors / DTensors (``{"model": ..., "optim": ...}``).
        meta: JSON-serialisable state that is the same on every rank (step, sampler, scheduler).
    """
    root = Path(root)
    final = root / f"step_{step:08d}"
    tmp = root / f"step_{step:08d}.tmp"
    rank = _rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        if final.exists():  # re-saving a step (e.g. after a resume): replace it atomically
            shutil.rmtree(final)
        tmp.mkdir()
    _barrier()
    with warnings.catch_warnings():  # one process without a process group is a supported case
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(tensors, checkpoint_id=str(tmp))
    torch.save(_rng_state(), tmp / f"rng_rank{rank}.pt")
    if rank == 0:
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    _barrier()
    if rank == 0:
        tmp.rename(final)
        complete = sorted(p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name))
        for old in complete[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(path: Path, tensors: dict[str, Any]) -> dict[str, Any]:
    """Collective: load DCP tensors in place into ``tensors``; restore RNG; return ``meta``."""
    path = Path(path)
    load_tensors(path, tensors)
    rng = path / f"rng_rank{_rank()}.pt"
    if rng.exists():
        _set_rng_state(torch.load(rng, weights_only=False))
    return json.loads((path / "meta.json").read_text())


def load_tensors(path: Path, tensors: dict[str, Any]) -> None:
    """Collective: load only the DCP tensors named in ``tensors`` (e.g. ``{"model": ...}`` for a
    weights-only start), in place; RNG and meta untouched. Raises if a name is missing."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(tensors, checkpoint_id=str(path))


def _rng_state() -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
