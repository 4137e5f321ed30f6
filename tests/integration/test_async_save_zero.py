"""Asynchronous checkpoints under ZeRO-1/2/3 (master shards are views into flat buffers), and what
a failing asynchronous save leaves behind.

Reference: the uninterrupted run of the same config and layout (2 gloo ranks, float64, one thread
each): deterministic, and a resume restores every bit of state, so the resumed losses, grad norms
and final weights must be bitwise equal (``==``).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ndtrain.checkpoint import dcp as ckpt
from ndtrain.checkpoint import staging
from ndtrain.config import load_config
from ndtrain.data import prepare_data
from ndtrain.train.loop import run
from ndtrain.train.metrics import read_metrics
from ndtrain.train.rundir import RunDir
from tests.corpus import source_text
from tests.dist_utils import run_ranks


def _cfg(tmp: Path, world: int, **over):
    corpus = tmp / "corpus.txt"
    if not corpus.exists():
        corpus.write_text(source_text(30000))
    base = {"data.source": str(corpus), "data.tokenizer": "bytes", "data.cache_dir": str(tmp / "cache"),
            "data.seq_len": 16, "model.vocab_size": 257, "model.dim": 30, "model.n_heads": 3,
            "model.n_kv_heads": 1, "model.ffn_hidden": 45, "training.dtype": "float64",
            "training.steps": 8, "training.global_batch_size": 4, "training.micro_batch_size": 1,
            "training.lr": 0.01, "training.eval_every": 0, "training.sample_tokens": 0,
            "logging.log_every": 1, "logging.plot": False, "checkpoint.every": 4,
            "checkpoint.async_save": "true"}
    base.update({k: str(v) for k, v in over.items()})
    return load_config("debug", base, world_size=world)


def _rows(run_dir: Path) -> dict[int, tuple[float, float]]:
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in read_metrics(run_dir) if "loss" in r}


def _zero_runs(rank: int, world: int, tmp: str) -> None:
    """Per ZeRO stage: one uninterrupted run, and one stopped at step 4 then resumed."""
    tmp_path = Path(tmp)
    for stage in (1, 2, 3):
        cfg = _cfg(tmp_path, world, **{"parallel.zero_stage": stage})
        data = prepare_data(cfg.data, cfg.model.vocab_size)
        run(cfg, tmp_path / f"full{stage}", data, torch.device("cpu"))
        run(_cfg(tmp_path, world, **{"parallel.zero_stage": stage, "training.stop_at_step": 4}),
            tmp_path / f"split{stage}", data, torch.device("cpu"))
        run(cfg, tmp_path / f"split{stage}", data, torch.device("cpu"))


def test_async_save_under_zero_resumes_bitwise(tmp_path):
    prepare_data(_cfg(tmp_path, 2).data, 257)  # the ranks reuse the cached shards
    run_ranks(_zero_runs, 2, str(tmp_path), timeout_s=600)
    for stage in (1, 2, 3):
        full, split = _rows(tmp_path / f"full{stage}"), _rows(tmp_path / f"split{stage}")
        assert sorted(full) == sorted(split) == list(range(1, 9)), stage
        assert all(split[s] == full[s] for s in range(1, 9)), (stage, full, split)
        assert full[8][0] < full[1][0]  # it trains
        for name in ("full", "split"):
            root = tmp_path / f"{name}{stage}" / "checkpoints"
            assert sorted(p.name for p in root.iterdir()) == ["step_00000004", "step_00000008"]
            assert ckpt.usable_checkpoint(root) == root / "step_00000008"
        a, _ = RunDir.open(tmp_path / f"full{stage}").load_model(8, dtype=torch.float64)
        b, _ = RunDir.open(tmp_path / f"split{stage}").load_model(8, dtype=torch.float64)
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), stage


def test_failed_staging_leaves_no_half_checkpoint(tmp_path, monkeypatch):
    """Staging fails at the second save: the error reaches the caller, step 4 stays the newest
    usable checkpoint and no ``step_00000008.tmp`` is left; a rerun resumes bitwise."""
    torch.set_num_threads(1)
    cfg = _cfg(tmp_path, 1)
    data = prepare_data(cfg.data, cfg.model.vocab_size)
    run(cfg, tmp_path / "full", data)
    real, calls = staging.OwnedCopyStager.stage, []

    def failing_second(self, state):
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("host memory exhausted")
        return real(self, state)

    monkeypatch.setattr(staging.OwnedCopyStager, "stage", failing_second)
    with pytest.raises(MemoryError, match="host memory exhausted"):
        run(cfg, tmp_path / "r", data)
    root = tmp_path / "r" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_00000004"]
    assert ckpt.usable_checkpoint(root) == root / "step_00000004"
    monkeypatch.setattr(staging.OwnedCopyStager, "stage", real)
    run(cfg, tmp_path / "r", data)
    assert _rows(tmp_path / "r") == _rows(tmp_path / "full")


def test_owned_copy_detaches_views_and_keeps_ties():
    """A view at an offset into a flat buffer (a ZeRO shard) is copied alone: later writes to the
    buffer do not reach the copy, the copy's storage holds only its elements, and one object
    listed twice stays one object."""
    flat = torch.arange(12, dtype=torch.float64)
    view = flat[4:10].view(2, 3)
    tree = {"model": {"a": view, "tied": view}, "optim": {"step": torch.tensor(3.0), "lr": [0.1]}}
    out = staging.owned_cpu_copy(tree)
    flat.zero_()
    assert out["model"]["a"].tolist() == [[4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]
    assert out["model"]["a"].untyped_storage().nbytes() == 6 * 8
    assert out["model"]["tied"] is out["model"]["a"]
    assert out["optim"]["lr"] == [0.1] and out["optim"]["lr"] is not tree["optim"]["lr"]
