"""End-to-end training through ``ndtrain.train.loop.run``: exact resume, atomic checkpoints, the CLI.

Reference for resume: an uninterrupted run of the same config in the same process. float32 on CPU
is deterministic for a fixed thread count, so the resumed losses must equal the uninterrupted ones
exactly (we allow 1e-7 relative only for safety against library-level reduction order changes).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ndtrain.checkpoint import dcp as ckpt
from ndtrain.config import load_config
from ndtrain.data import prepare_data
from ndtrain.train.loop import run
from ndtrain.train.metrics import read_metrics
from tests.corpus import source_text


def _corpus(tmp_path: Path) -> Path:
    text = source_text(60000)
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    return path


def _cfg(tmp_path: Path, **over):
    base = {"data.source": str(_corpus(tmp_path)), "data.tokenizer": "bytes",
            "data.cache_dir": str(tmp_path / "cache"), "training.steps": 20, "logging.log_every": 1,
            "training.eval_every": 0, "checkpoint.every": 5, "training.sample_tokens": 8}
    base.update(over)
    return load_config("debug", base, world_size=1)


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def test_stop_and_resume_equals_uninterrupted(tmp_path):
    torch.set_num_threads(1)
    cfg = _cfg(tmp_path)
    data = prepare_data(cfg.data, cfg.model.vocab_size)
    run(cfg, tmp_path / "full", data)
    run(_cfg(tmp_path, **{"training.stop_at_step": 10}), tmp_path / "split", data)
    assert ckpt.latest_checkpoint(tmp_path / "split" / "checkpoints").name == "step_00000010"
    run(cfg, tmp_path / "split", data)  # resumes from step 10 in the same run dir
    full, split = _losses(tmp_path / "full"), _losses(tmp_path / "split")
    assert sorted(full) == list(range(1, 21))
    for step in range(11, 21):
        assert split[step] == pytest.approx(full[step], rel=1e-7, abs=0)
    assert full[20] < full[1]
    # keep_last=2: only the two newest complete checkpoints remain
    names = sorted(p.name for p in (tmp_path / "full" / "checkpoints").iterdir())
    assert names == ["step_00000015", "step_00000020"]


def test_crash_during_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    cfg = _cfg(tmp_path, **{"training.stop_at_step": 5})
    data = prepare_data(cfg.data, cfg.model.vocab_size)
    run(cfg, tmp_path / "r", data)
    real_save = ckpt.dcp.save

    def dying_save(state, checkpoint_id):
        real_save(state, checkpoint_id=checkpoint_id)  # files written, then the process "dies"
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(ckpt.dcp, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        run(_cfg(tmp_path, **{"training.stop_at_step": 10}), tmp_path / "r", data)
    root = tmp_path / "r" / "checkpoints"
    assert (root / "step_00000010.tmp").exists()
    assert ckpt.latest_checkpoint(root).name == "step_00000005"
    monkeypatch.setattr(ckpt.dcp, "save", real_save)
    run(_cfg(tmp_path, **{"training.stop_at_step": 10}), tmp_path / "r", data)
    assert ckpt.latest_checkpoint(root).name == "step_00000010"
    assert not (root / "step_00000010.tmp").exists()
    steps = [r["step"] for r in read_metrics(tmp_path / "r") if "loss" in r]
    assert steps == list(range(1, 11))  # steps 6-10 redone after the crash, logged once
    assert (tmp_path / "r" / "metrics.prev.jsonl").exists()  # the crashed job's rows are kept aside


def test_cli_two_processes(tmp_path):
    """The launcher: 2 gloo processes, metrics with every required key, a sample and a plot."""
    run_dir = tmp_path / "run"
    corpus = _corpus(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "ndtrain.cli.commands", "train", "--config", "debug", "--nproc", "2",
         f"--run-dir={run_dir}", f"--data.source={corpus}", "--data.tokenizer=bytes",
         f"--data.cache_dir={tmp_path / 'cache'}", "--training.steps=6", "--logging.log_every=3",
         "--logging.plot=true", "--training.sample_tokens=8"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = read_metrics(run_dir)
    last = [r for r in rows if "loss" in r][-1]
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_bytes", "val_loss"):
        assert key in last, key
    assert 0 < last["mfu"] < 1 and last["peak_mem_bytes"] > 0
    assert "layout dp_shard2 (world 2)" in proc.stdout and "sample:" in proc.stdout
    assert (run_dir / "loss.png").stat().st_size > 1000
    assert json.loads(json.dumps(rows))  # JSONL is plain JSON
    assert (run_dir / "config.yaml").exists()


def _val0(run_dir: Path) -> float:
    return next(r["val_loss"] for r in read_metrics(run_dir) if r["step"] == 0)


def test_own_checkpoint_wins_over_load_from_and_clear_errors(tmp_path, capsys):
    """A run started from ``load_from`` resumes from its own newest checkpoint
    when run again; the console names the checkpoint; ``load_from`` past ``training.steps`` and a
    folder that is not a checkpoint are errors, not silent no-ops."""
    torch.set_num_threads(1)
    over = {"training.steps": 6, "checkpoint.every": 2}
    cfg = _cfg(tmp_path, **over)
    data = prepare_data(cfg.data, cfg.model.vocab_size)
    run(cfg, tmp_path / "other", data)
    other6 = tmp_path / "other" / "checkpoints" / "step_00000006"
    run(_cfg(tmp_path, **over, **{"training.stop_at_step": 2}), tmp_path / "src", data)
    src2 = tmp_path / "src" / "checkpoints" / "step_00000002"
    capsys.readouterr()
    started = _cfg(tmp_path, **over, **{"checkpoint.load_from": str(src2), "training.stop_at_step": 4})
    run(started, tmp_path / "b", data)
    assert f"resumed from {src2} (checkpoint.load_from) at step 2" in capsys.readouterr().out
    run(_cfg(tmp_path, **over, **{"checkpoint.load_from": str(src2)}), tmp_path / "b", data)
    own = tmp_path / "b" / "checkpoints" / "step_00000004"
    assert f"resumed from {own} (the run's newest usable checkpoint) at step 4" in capsys.readouterr().out
    full, b = _losses(tmp_path / "other"), _losses(tmp_path / "b")
    assert sorted(b) == [3, 4, 5, 6]  # steps 3-4 once, then 5-6 after the own step-4 checkpoint
    for step in (3, 4, 5, 6):
        assert b[step] == pytest.approx(full[step], rel=1e-7, abs=0)
    with pytest.raises(ValueError, match=r"at step 6, past training.steps \(6\)"):
        run(_cfg(tmp_path, **over, **{"checkpoint.load_from": str(other6)}), tmp_path / "c", data)
    with pytest.raises(ValueError, match="not an ndtrain checkpoint folder"):
        run(_cfg(tmp_path, **over, **{"checkpoint.load_from": str(tmp_path)}), tmp_path / "d", data)


def test_init_weights_from_ndtrain_checkpoint_and_hf_folder(tmp_path, capsys):
    """``checkpoint.init_weights_from``: a fine-tune starts at step 0 with a fresh optimizer and
    schedule from another run's weights -- an ndtrain checkpoint or a Hugging Face folder. Its
    step-0 validation loss equals the source run's final one exactly (same weights, same batches)."""
    torch.set_num_threads(1)
    over = {"training.steps": 4, "checkpoint.every": 4, "model.tie_embeddings": "true"}
    cfg = _cfg(tmp_path, **over)
    data = prepare_data(cfg.data, cfg.model.vocab_size)
    run(cfg, tmp_path / "src", data)
    src = tmp_path / "src" / "checkpoints" / "step_00000004"
    final_val = [r for r in read_metrics(tmp_path / "src") if r["step"] == 4][-1]["val_loss"]
    assert _val0(tmp_path / "src") != pytest.approx(final_val, rel=1e-3)  # it trained
    capsys.readouterr()
    run(_cfg(tmp_path, **over, **{"checkpoint.init_weights_from": str(src)}), tmp_path / "ft", data)
    assert "initial weights from" in capsys.readouterr().out
    assert _val0(tmp_path / "ft") == pytest.approx(final_val, rel=1e-7, abs=0)
    assert sorted(_losses(tmp_path / "ft")) == [1, 2, 3, 4]  # a new run: steps 1.. with warmup again

    from ndtrain.hf.folder import save_hf_checkpoint
    from ndtrain.mesh import ParallelDims
    from ndtrain.train.loop import Trainer

    tr = Trainer(cfg, ParallelDims(world_size=1).build_mesh(), torch.device("cpu"))
    state = tr.tensor_state()
    ckpt.load_tensors(src, {"model": state["model"]})
    tr.load_model_state(state["model"])
    save_hf_checkpoint(tr.model, cfg.model, tmp_path / "hf")
    run(_cfg(tmp_path, **over, **{"checkpoint.init_weights_from": str(tmp_path / "hf")}), tmp_path / "ft_hf", data)
    assert _val0(tmp_path / "ft_hf") == pytest.approx(final_val, rel=1e-6, abs=0)
