"""What a run leaves behind on the way (``ndtrain.train.outputs``): a failed write (a full disk, a
read-only target) is one line naming the path and what was kept, and never harms the last good
checkpoint; ``loss.png`` exists after a run stopped early or interrupted, not only a completed one.

Single process; the OS errors are injected into the real writers (DCP's file writer, safetensors,
``Path.write_text``), since root ignores read-only permissions."""
from __future__ import annotations

import errno
import json
import os
import traceback
from pathlib import Path

import pytest
import torch

from ndtrain.checkpoint import dcp as ckpt
from ndtrain.checkpoint.integrity import verify
from ndtrain.config import load_config, save_config
from ndtrain.data import prepare_data
from ndtrain.errors import StorageError
from ndtrain.train import outputs
from ndtrain.train.loop import run
from ndtrain.train.metrics import read_metrics
from tests.corpus import source_text

ENOSPC = os.strerror(errno.ENOSPC)  # "No space left on device"


def _cfg(tmp_path: Path, **over):
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        corpus.write_text(source_text(60000))
    base = {"data.source": str(corpus), "data.tokenizer": "bytes", "data.cache_dir": str(tmp_path / "cache"),
            "training.steps": 6, "logging.log_every": 1, "training.eval_every": 0, "checkpoint.every": 2,
            "training.sample_tokens": 4, "training.global_batch_size": 4, "training.micro_batch_size": 2}
    base.update(over)
    return load_config("debug", base, world_size=1)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_full_disk_at_a_checkpoint_is_one_line_and_the_last_good_one_is_kept(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    cfg = _cfg(tmp_path, **{"training.stop_at_step": 2})
    data = prepare_data(cfg.data, cfg.model.vocab_size)
    run_dir = tmp_path / "run"
    run(cfg, run_dir, data)
    root = run_dir / "checkpoints"
    good = root / "step_00000002"
    before = _files(good)
    import torch.distributed.checkpoint.filesystem as fs

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, ENOSPC)  # what write(2) says on a full disk: no file name

    monkeypatch.setattr(fs, "_write_item", full)
    with pytest.raises(StorageError) as info:
        run(_cfg(tmp_path), run_dir, data)
    assert str(info.value) == (f"cannot write {root / 'step_00000004.tmp'}: {ENOSPC}; the last good "
                               "checkpoint step_00000002 is kept")
    chain = "".join(traceback.format_exception(info.value))
    assert chain.count("Traceback") == 1 and "CheckpointException" not in chain  # no chain of errors
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002"]  # the partial .tmp is removed
    assert verify(good) is None and _files(good) == before
    monkeypatch.undo()  # space again: the run resumes from the kept checkpoint and finishes
    run(_cfg(tmp_path), run_dir, data)
    assert ckpt.latest_checkpoint(root).name == "step_00000006"


def test_storage_error_finds_the_os_error_behind_any_wrapper(tmp_path):
    from safetensors import SafetensorError
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    root = tmp_path / "run" / "checkpoints"
    (root / "step_00000010").mkdir(parents=True)
    try:
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), str(root / "step_00000020.tmp" / "__1_0.distcp"))
    except OSError as e:
        dcp_error = CheckpointException("save failed", {1: _wrap_exception(e)})
    err = outputs.storage_error(dcp_error, root, root / "step_00000020.tmp")
    assert str(err) == (f"cannot write {root / 'step_00000020.tmp'}: {os.strerror(errno.EDQUOT)}; the last "
                        "good checkpoint step_00000010 is kept")
    metrics_file = tmp_path / "run" / "metrics.jsonl"
    try:
        try:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(metrics_file))
        except OSError as inner:
            raise RuntimeError("while logging") from inner
    except RuntimeError as outer:
        assert str(outputs.storage_error(outer, root)) == (
            f"cannot write {metrics_file}: {os.strerror(errno.EROFS)}; the last good checkpoint "
            "step_00000010 is kept")
    st = SafetensorError("Error while serializing: I/O error: File too large (os error 27)")
    assert outputs.write_failure(st, "out", "kept") == f"cannot write out: {os.strerror(errno.EFBIG)}; kept"
    assert outputs.storage_error(ValueError("no"), root) is None
    assert outputs.storage_error(OSError(errno.ENOENT, "missing"), root) is None  # a read, not storage
    assert outputs.storage_error(StorageError("x"), root) is None  # already the one line
    assert outputs.kept(tmp_path / "nothing") == "no checkpoint had been completed yet"


def _run_dir_with_checkpoint(tmp_path: Path) -> Path:
    """A run directory as training leaves it, made directly: config.yaml and one checkpoint."""
    from ndtrain.model import Transformer

    cfg = _cfg(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    save_config(cfg, run_dir / "config.yaml")
    ckpt.save_checkpoint(run_dir / "checkpoints", 2, {"model": Transformer(cfg.model).state_dict()}, {"step": 2})
    return run_dir


def test_read_only_to_hf_and_json_targets_are_one_line(tmp_path, monkeypatch, capsys):
    from safetensors import SafetensorError

    from ndtrain.cli.commands import main

    run_dir = _run_dir_with_checkpoint(tmp_path)
    before = _files(run_dir / "checkpoints" / "step_00000002")

    def read_only(*_a, **_k):
        raise SafetensorError("Error while serializing: I/O error: Read-only file system (os error 30)")

    monkeypatch.setattr("safetensors.torch.save_file", read_only)
    out = tmp_path / "hf"
    assert main(["convert", "--run-dir", str(run_dir), "--to-hf", str(out)]) == 1
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"ndtrain convert: cannot write {out}: {os.strerror(errno.EROFS)}; the source is unchanged"]
    assert _files(run_dir / "checkpoints" / "step_00000002") == before

    target = tmp_path / "ro" / "eval.json"
    real_write = Path.write_text

    def refuse(self, *a, **k):
        if self == target:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real_write(self, *a, **k)

    monkeypatch.setattr(Path, "write_text", refuse)
    assert main(["eval", "--run-dir", str(run_dir), "--batches", "1", "--device", "cpu",
                 "--json", str(target)]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["checkpoint_step"] == 2  # the result still reached stdout
    assert captured.err.splitlines() == [
        f"ndtrain eval: cannot write {target}: {os.strerror(errno.EROFS)}; the result is printed above"]


def test_loss_png_after_a_stop_at_step_and_after_an_interruption(tmp_path, monkeypatch):
    """Before, loss.png was written only when a run reached training.steps."""
    torch.set_num_threads(1)
    over = {"logging.plot": True, "training.stop_at_step": 3, "checkpoint.every": 0, "training.eval_every": 2}
    cfg = _cfg(tmp_path, **over)
    data = prepare_data(cfg.data, cfg.model.vocab_size)
    stopped = tmp_path / "stopped"
    run(cfg, stopped, data)
    assert (stopped / "loss.png").stat().st_size > 0
    assert not (stopped / "checkpoints").exists()  # written at the evaluation / the job's end

    from ndtrain.train.trainer import Trainer

    real_step, calls = Trainer.step, []

    def interrupted_step(self, inputs, labels, documents=None):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # Ctrl-C during step 3, before any checkpoint or evaluation
        return real_step(self, inputs, labels, documents)

    monkeypatch.setattr(Trainer, "step", interrupted_step)
    cut = tmp_path / "cut"
    with pytest.raises(KeyboardInterrupt):
        run(_cfg(tmp_path, **{"logging.plot": True, "checkpoint.every": 0, "training.eval_every": 0}), cut, data)
    assert [r["step"] for r in read_metrics(cut)] == [0, 1, 2]
    assert (cut / "loss.png").stat().st_size > 0


def test_a_full_disk_at_start_up_is_one_line_too(tmp_path, monkeypatch):
    """Before the first step: the data cache (launcher) and config.yaml (rank 0's set-up)."""
    from ndtrain.cli import launch as launch_mod
    from ndtrain.train import loop

    cfg = _cfg(tmp_path)
    shard = tmp_path / "cache" / "train.bin"

    def full_cache(*_a, **_k):
        raise OSError(errno.ENOSPC, ENOSPC, str(shard))

    monkeypatch.setattr("ndtrain.data.prepare_data", full_cache)
    with pytest.raises(StorageError) as info:
        launch_mod.prepare_checked(cfg)
    assert str(info.value) == f"cannot write {shard}: {ENOSPC}; no step was trained"
    monkeypatch.undo()
    data = prepare_data(cfg.data, cfg.model.vocab_size)

    def read_only(_cfg, path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(loop, "save_config", read_only)
    with pytest.raises(StorageError) as info:
        run(cfg, tmp_path / "run", data)
    assert str(info.value) == (f"cannot write {tmp_path / 'run' / 'config.yaml'}: {os.strerror(errno.EROFS)}; "
                               "no checkpoint had been completed yet")
