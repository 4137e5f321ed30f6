"""Distributed checkpoints with ``torch.distributed.checkpoint`` (DCP): atomic, verified, optionally
asynchronous, keep-last-k, resumable.

Layout: ``CKPT_ROOT/step_00000010/`` holds the DCP files of the tensor state (model, optimizer; each
rank writes its own shards, and DCP's planner de-duplicates replicated tensors), ``meta.json``
(step, LR scheduler, data sampler, layout; identical on all ranks), ``rng_rank{r}.pt`` (each rank's
RNG states) and ``manifest.json`` (size and CRC-32 of every other file; ``ndtrain.checkpoint.integrity``).

Atomicity: everything is written into ``step_XXXXXXXX.tmp``; once every rank's files are on disk,
rank 0 writes the manifest and renames the folder to ``step_XXXXXXXX``. A process killed mid-save
leaves only a ``.tmp`` folder, which ``latest_checkpoint`` ignores (and the next save removes), so
the previous checkpoint stays the newest complete one. Old complete checkpoints beyond
``keep_last`` are deleted only after that rename, so the newest verified checkpoint is never
deleted before a newer one is complete.

Integrity: ``usable_checkpoint`` verifies the newest complete checkpoint against its manifest and
falls back to the previous one when a file is missing, truncated or corrupted (one printed line,
a ``checkpoint_corrupt`` event, the folder renamed ``step_XXXXXXXX.corrupt`` for inspection); when
checkpoints exist but none verifies it raises ``CheckpointUnusableError`` instead of starting over.

Asynchronous saves (``CheckpointSaver(async_save=True)``): DCP ``async_save`` copies the state to
host memory (the only part the training loop waits for; ``staging.OwnedCopyStager``: one owned
CPU tensor per tensor, which also serves DTensors whose local tensors are views of flat ZeRO
shards) and writes it from a background thread over a dedicated gloo group, so its collectives
never interleave with the training's. The checkpoint is finalised (manifest, rename, keep_last)
only after the write finished; the next save, and the end of the run (``wait``), wait for it
first. A save that fails (staging or the background write) removes its ``.tmp`` folder before the
error reaches the loop; the previous checkpoint stays the newest.

Resharding: DCP stores tensors by fully qualified name with their global shapes, so a checkpoint
saved under one layout loads into the state dict of another as long as each layout presents its
state under the same names and global shapes.
"""
from __future__ import annotations

import json
import pickle
import re
import shutil
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ndtrain.checkpoint.integrity import CheckpointUnusableError, verify, write_manifest
from ndtrain.checkpoint.staging import OwnedCopyStager
from ndtrain.events import log_event

__all__ = ["CheckpointDamagedError", "CheckpointSaver", "CheckpointUnusableError", "latest_checkpoint",
           "load_checkpoint", "load_tensors", "require_verified", "save_checkpoint", "usable_checkpoint"]

_STEP_DIR = re.compile(r"^step_(\d{8})$")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint folders under ``root`` (``step_XXXXXXXX``), oldest first; unverified."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name))


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint folder under ``root`` by name (``.tmp`` / ``.corrupt``
    folders are ignored); its files are not verified (``usable_checkpoint`` does that)."""
    done = complete_checkpoints(root)
    return done[-1] if done else None


def usable_checkpoint(root: Path, run_dir: Path | None = None) -> Path | None:
    """Collective: the newest complete checkpoint under ``root`` whose files match its manifest.

    Rank 0 verifies (reads every file once) and tells the others. Each checkpoint that fails is
    reported in one line, logged as a ``checkpoint_corrupt`` event in ``run_dir`` (step, path,
    reason) and renamed ``step_XXXXXXXX.corrupt``. Returns None when ``root`` holds no complete
    checkpoint.

    Raises:
        CheckpointUnusableError: complete checkpoints exist but none verifies.
    """
    answer = [None]
    if _rank() == 0:
        answer[0] = _pick_verified(Path(root), run_dir)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(answer, src=0)
    kind, value = answer[0]
    if kind == "error":
        raise CheckpointUnusableError(value)
    return None if value is None else Path(value)


def _pick_verified(root: Path, run_dir: Path | None) -> tuple[str, str | None]:
    candidates = complete_checkpoints(root)[::-1]
    problems = []
    for path in candidates:
        problem = verify(path)
        if problem is None:
            return "ok", str(path)
        problems.append(f"{path.name}: {problem}")
        print(f"checkpoint {path} is unusable ({problem}); trying the previous one", flush=True)
        if run_dir is not None:
            log_event(run_dir, "checkpoint_corrupt", step=int(path.name[5:]), path=str(path), reason=problem)
        aside = path.with_name(path.name + ".corrupt")
        shutil.rmtree(aside, ignore_errors=True)
        path.rename(aside)
    if problems:
        return "error", (f"{root} holds checkpoints but none verifies ({'; '.join(problems)}); they were "
                         "renamed *.corrupt. Not starting from scratch: restore a checkpoint, or set "
                         "checkpoint.resume=false to train from step 0 on purpose")
    return "ok", None


class CheckpointDamagedError(ValueError):
    """A checkpoint folder a command or config key names fails its manifest or cannot be read;
    the message is one line: the key, the folder, the file and what failed."""


def require_verified(path: Path, key: str) -> None:
    """Raise CheckpointDamagedError (``key``: the config key or flag naming ``path``) when ``path``
    fails its manifest. Collective when a process group is up: rank 0 reads the files once and
    tells the others, so every rank raises the same error."""
    answer = [verify(Path(path)) if _rank() == 0 else None]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(answer, src=0)
    if answer[0] is not None:
        raise CheckpointDamagedError(f"{key}={path}: the checkpoint is damaged ({answer[0]})")


class CheckpointSaver:
    """Saves checkpoints into ``root``, synchronously or with DCP ``async_save``; one per run.

    ``save`` is collective (every rank calls it at the same step); ``wait`` must be called by every
    rank before the process group is torn down (it finishes a pending asynchronous save). Rank 0
    logs a ``checkpoint`` event per finalised save to ``run_dir`` (when given): ``step``,
    ``async``, ``block_s`` (seconds ``save`` kept the training loop waiting) and ``total_s``
    (from the call until the checkpoint was complete).
    """

    def __init__(self, root: Path, keep_last: int = 2, async_save: bool = False, run_dir: Path | None = None):
        self.root, self.keep_last, self.async_save = Path(root), keep_last, async_save
        self.run_dir = None if run_dir is None else Path(run_dir)
        self._group = None
        self._pending: tuple | None = None  # (future, finaliser thread or None, errors)

    def save(self, step: int, tensors: dict[str, Any], meta: dict[str, Any]) -> float:
        """Write ``tensors`` (state dict tree of tensors / DTensors) and ``meta`` (JSON, the same on
        every rank) as ``step``; returns the blocking time in seconds (includes waiting for the
        previous asynchronous save)."""
        t0 = time.perf_counter()
        self.wait()
        final, tmp = self.root / f"step_{step:08d}", self.root / f"step_{step:08d}.tmp"
        rank = _rank()
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob("*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        _barrier()
        # RNG and meta first: when any rank's DCP write is complete, these files are already there.
        torch.save(_rng_state(), tmp / f"rng_rank{rank}.pt")
        if rank == 0:
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        if not self.async_save:
            with warnings.catch_warnings():  # one process without a process group is a supported case
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.save(tensors, checkpoint_id=str(tmp))
            _barrier()
            if rank == 0:
                self._finalise(tmp, final)
            _barrier()
            block_s = time.perf_counter() - t0  # the loop waited for all of it, manifest included
            if rank == 0:
                self._log(step, final, block_s, block_s)
            return block_s
        try:
            future = self._async_write(tensors, tmp)
        except BaseException:
            _discard(tmp)  # a staging failure: no half checkpoint stays behind on this rank's watch
            raise
        block_s = time.perf_counter() - t0
        errors: list[BaseException] = []
        thread = None
        if rank == 0:  # rank 0's write completes only after every rank's: DCP gathers them to finish
            thread = threading.Thread(target=self._finalise_after, name=f"ndtrain-ckpt-{step}", daemon=True,
                                      args=(future, errors, step, tmp, final, block_s, t0))
            thread.start()
        self._pending = (future, thread, errors)
        return block_s

    def wait(self) -> None:
        """Block until this rank's pending asynchronous save (if any) is written and, on rank 0,
        finalised; re-raises its error. Not collective."""
        if self._pending is None:
            return
        future, thread, errors = self._pending
        self._pending = None
        if thread is not None:
            thread.join()
            if errors:
                raise errors[0]
        else:
            future.result()

    def _async_write(self, tensors, tmp: Path):
        distributed = dist.is_available() and dist.is_initialized()
        if distributed and self._group is None:
            self._group = dist.new_group(backend="gloo")  # collective: every rank saves at this step
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            response = dcp.async_save(tensors, checkpoint_id=str(tmp), process_group=self._group,
                                      async_stager=OwnedCopyStager(), no_dist=not distributed)
        return getattr(response, "upload_completion", response)

    def _finalise_after(self, future, errors, step, tmp, final, block_s, t0) -> None:
        try:
            future.result()
            self._finalise(tmp, final)
            self._log(step, final, block_s, time.perf_counter() - t0)
        except BaseException as e:  # noqa: BLE001 - handed to wait(), which re-raises it in the loop
            _discard(tmp)
            errors.append(e)

    def _finalise(self, tmp: Path, final: Path) -> None:
        """Rank 0, once every rank's files are in ``tmp``: manifest, atomic rename, keep_last."""
        write_manifest(tmp)
        if final.exists():  # re-saving a step (e.g. after a rollback): swap, never a moment without it
            old = final.with_name(final.name + ".replaced.tmp")
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        for stale in complete_checkpoints(self.root)[:-self.keep_last]:
            shutil.rmtree(stale, ignore_errors=True)

    def _log(self, step: int, final: Path, block_s: float, total_s: float) -> None:
        if self.run_dir is not None:
            log_event(self.run_dir, "checkpoint", step=step, path=str(final), **{"async": self.async_save},
                      block_s=round(block_s, 6), total_s=round(total_s, 6))


def _discard(tmp: Path) -> None:
    """Remove the ``.tmp`` folder of a failed save (never a complete checkpoint: its name has no
    ``.tmp``), so neither a resume nor an after-training command can meet a half checkpoint."""
    if tmp.name.endswith(".tmp"):
        shutil.rmtree(tmp, ignore_errors=True)


def save_checkpoint(root: Path, step: int, tensors: dict[str, Any], meta: dict[str, Any],
                    keep_last: int = 2) -> Path:
    """Collective, synchronous: ``CheckpointSaver(root, keep_last).save(...)``; returns the final
    folder path.

    Args:
        tensors: state dict tree of tensors / DTensors (``{"model": ..., "optim": ...}``).
        meta: JSON-serialisable state that is the same on every rank (step, sampler, scheduler).
    """
    CheckpointSaver(root, keep_last).save(step, tensors, meta)
    return Path(root) / f"step_{step:08d}"


def load_checkpoint(path: Path, tensors: dict[str, Any]) -> dict[str, Any]:
    """Collective: load DCP tensors in place into ``tensors``; restore RNG; return ``meta``. The
    caller has verified ``path`` (``usable_checkpoint`` / ``require_verified``)."""
    path = Path(path)
    load_tensors(path, tensors, verified=True)
    rng = path / f"rng_rank{_rank()}.pt"
    if rng.exists():
        _set_rng_state(torch.load(rng, weights_only=False))
    return json.loads((path / "meta.json").read_text())


def load_tensors(path: Path, tensors: dict[str, Any], key: str = "checkpoint",
                 verified: bool = False) -> None:
    """Collective: load only the DCP tensors named in ``tensors`` (e.g. ``{"model": ...}`` for a
    weights-only start), in place; RNG and meta untouched. The one reader of checkpoint tensors:
    unless ``verified``, ``path`` is first checked against its manifest (``require_verified``).

    Raises:
        CheckpointDamagedError: a file fails the manifest, or DCP cannot read one (a folder
            without a manifest, truncated: one line instead of DCP's raw EOFError).
        RuntimeError / KeyError: a name of ``tensors`` is missing from the checkpoint.
    """
    if not verified:
        require_verified(path, key)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(tensors, checkpoint_id=str(path))
        except (CheckpointException, EOFError, OSError, pickle.UnpicklingError) as e:
            cause = next(iter(e.failures.values()))[0] if isinstance(e, CheckpointException) else e
            if isinstance(cause, (RuntimeError, KeyError)) and "issing key" in str(cause):
                raise cause from None  # a name this checkpoint lacks: not damage
            detail = str(cause).strip().splitlines()[0] if str(cause).strip() else "a file ends early"
            raise CheckpointDamagedError(f"{key}={path}: unreadable checkpoint "
                                         f"({type(cause).__name__}: {detail})") from e


def _rng_state() -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
