"""What a run leaves in its run directory on the way, and a failed write said in one line.

``loss.png`` (``refresh_plot``, rank 0, ``logging.plot``) is rewritten from ``metrics.jsonl`` after
every checkpoint and evaluation, at the end of every job and after an interruption
(``ndtrain.train.loop``), so a run stopped early still has its curve.

A failed write after launch is one line: the path, the OS's reason and what was kept.

A full disk (or a quota, a read-only remount, a file-size limit) during training surfaces as an
``OSError`` from wherever the write was: DCP's checkpoint writer (wrapped in its
``CheckpointException``, per rank), ``metrics.jsonl``, ``events.jsonl``, ``loss.png``.
``storage_error`` finds that ``OSError`` behind any of them and turns it into one
``StorageError`` line, "cannot write PATH: No space left on device; the last good checkpoint
step_00000030 is kept"; ``ndtrain train`` prints only that line (exit 1).

A checkpoint that fails to write never harms the previous one: it is written into
``step_N.tmp`` and the older checkpoints are deleted only after the new one is complete
(``ndtrain.checkpoint.dcp``); ``raise_storage_error`` removes the partial ``.tmp`` folder to give the
space back.
"""
from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

from ndtrain.errors import StorageError

WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG}  # "cannot write"
ACCESS_ERRNOS = {errno.EACCES, errno.EPERM, errno.EIO, errno.ESTALE}  # "cannot access"


def find_oserror(exc: BaseException | None) -> OSError | None:
    """The ``OSError`` of storage (``WRITE_ERRNOS`` / ``ACCESS_ERRNOS``) behind ``exc``: itself, its
    ``__cause__`` / ``__context__`` chain, or a DCP ``CheckpointException``'s per-rank failures."""
    stack, seen = [exc], set()
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in WRITE_ERRNOS | ACCESS_ERRNOS:
            return e
        code = re.search(r"\(os error (\d+)\)", str(e)) if type(e).__name__ == "SafetensorError" else None
        if code and int(code.group(1)) in WRITE_ERRNOS | ACCESS_ERRNOS:  # safetensors' own I/O error
            return OSError(int(code.group(1)), os.strerror(int(code.group(1))))
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
        if isinstance(failures, dict):
            stack.extend(f[0] for f in failures.values() if isinstance(f, tuple) and f)
        stack.extend((e.__cause__, e.__context__))
    return None


def kept(ckpt_root: Path) -> str:
    """What a failed write leaves usable: "the last good checkpoint step_N is kept", or that there is none."""
    from ndtrain.checkpoint.dcp import latest_checkpoint

    last = latest_checkpoint(Path(ckpt_root))
    return f"the last good checkpoint {last.name} is kept" if last else "no checkpoint had been completed yet"


def failure_line(os_err: OSError, path: Path | str, kept_what: str) -> str:
    """``"cannot write PATH: No space left on device; KEPT_WHAT"``."""
    verb = "cannot write" if os_err.errno in WRITE_ERRNOS else "cannot access"
    reason = os_err.strerror or errno.errorcode.get(os_err.errno, str(os_err))
    return f"{verb} {path}: {reason}; {kept_what}"


def write_failure(exc: BaseException, target: Path | str, kept_what: str) -> str | None:
    """The one line for a failed write of ``target`` (its file when the error names one), or None
    when no storage error is behind ``exc``: for the after-training commands' outputs."""
    os_err = find_oserror(exc)
    return None if os_err is None else failure_line(os_err, os_err.filename or target, kept_what)


def storage_error(exc: BaseException, ckpt_root: Path, writing: Path | None = None) -> StorageError | None:
    """``StorageError`` for ``exc`` when a storage ``OSError`` is behind it, else None.

    ``writing``: the folder being written (a checkpoint's ``.tmp``), named instead of the file inside
    it; otherwise the ``OSError``'s own file name, else ``ckpt_root``'s run directory."""
    if isinstance(exc, StorageError):
        return None
    os_err = find_oserror(exc)
    if os_err is None:
        return None
    path = Path(os_err.filename) if os_err.filename else None
    if writing is not None and (path is None or Path(writing) in (path, *path.parents)):
        path = Path(writing)
    return StorageError(failure_line(os_err, path or Path(ckpt_root).parent, kept(ckpt_root)))


def raise_storage_error(exc: BaseException, ckpt_root: Path, rank: int, tmp: Path | None = None) -> None:
    """Raise ``exc`` as its one-line StorageError when a failed write is behind it (else return);
    rank 0 removes ``tmp``, the partial checkpoint folder, to give its space back (best effort)."""
    err = storage_error(exc, ckpt_root, tmp)
    if err is None:
        return
    if tmp is not None and rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    raise err from None


def refresh_plot(run_dir: Path, on: bool, quiet: bool = True, safe: bool = False) -> None:
    """Rewrite ``RUN_DIR/loss.png`` from ``metrics.jsonl`` when ``on`` (``logging.plot``) and there
    are rows; prints its path unless ``quiet``. ``safe`` (leaving an interrupted run): a plot that
    fails is skipped, so the interruption itself is what the run reports."""
    from ndtrain.train.metrics import plot_run

    if not on or not (Path(run_dir) / "metrics.jsonl").is_file():
        return
    try:
        path = plot_run(run_dir)
    except Exception:
        if safe:
            return
        raise
    if not quiet:
        print(f"plot: {path}", flush=True)
