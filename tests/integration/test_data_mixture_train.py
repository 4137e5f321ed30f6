"""A mixture trains through ``ndtrain.train.loop.run``, and a run stopped under dp 2 (two gloo ranks)
resumes in one process (another world size and dp degree) with the uninterrupted run's losses."""
from __future__ import annotations

import numpy as np
import pytest

from ndtrain.cli.launch import prepare_checked
from ndtrain.train.loop import run
from ndtrain.train.metrics import read_metrics
from tests.dist_utils import run_ranks
from tests.utils import tiny_config


def _cfg(tmp_path, **over):
    rng = np.random.default_rng(0)
    np.save(tmp_path / "a.npy", rng.integers(0, 30, 4000).astype(np.uint16))
    np.save(tmp_path / "b.npy", rng.integers(30, 61, 3000).astype(np.uint16))
    np.save(tmp_path / "b_off.npy", np.arange(0, 3000, 37))
    sources = [{"kind": "tokens", "path": str(tmp_path / "a.npy"), "eos_id": 0, "weight": 0.7, "name": "a"},
               {"kind": "tokens", "path": str(tmp_path / "b.npy"), "offsets": str(tmp_path / "b_off.npy"),
                "weight": 0.3, "name": "b"}]
    import json

    base = {"data.sources": json.dumps(sources), "data.tokenizer": "bytes", "model.vocab_size": 260,
            "data.cache_dir": str(tmp_path / "cache"), "training.steps": 6, "logging.log_every": 1,
            "training.eval_every": 0, "training.eval_batches": 1, "checkpoint.every": 3,
            "training.sample_tokens": 0, "logging.plot": False, "logging.progress": "plain",
            "training.global_batch_size": 4}
    base.update(over)
    return tiny_config(base)


def _train_rank(rank, world, cfg, run_dir, data_path):
    run(cfg, run_dir, data_path)


def _rows(run_dir):
    return {r["step"]: r for r in read_metrics(run_dir) if "loss" in r}


@pytest.mark.slow
def test_mixture_resume_on_another_world_size(tmp_path):
    cfg = _cfg(tmp_path)
    data = prepare_checked(cfg)
    run(cfg, tmp_path / "full", data)
    run_ranks(_train_rank, 2, _cfg(tmp_path, **{"training.stop_at_step": 3}), tmp_path / "split", data)
    run(cfg, tmp_path / "split", data)  # world 1 resumes the dp-2 checkpoint at step 3
    full, split = _rows(tmp_path / "full"), _rows(tmp_path / "split")
    assert sorted(full) == list(range(1, 7))
    for step in range(1, 7):
        assert abs(split[step]["loss"] - full[step]["loss"]) <= 1e-10 * abs(full[step]["loss"])
        assert split[step]["data_share_a"] == full[step]["data_share_a"]
    assert full[6]["data_share_a"] + full[6]["data_share_b"] == 1.0
    from ndtrain.data.mixture import MixtureData

    seen = MixtureData(data, seed=cfg.training.seed).plans["train"].seen(6 * 4)  # the 24 sequences trained
    assert full[6]["data_share_a"] == seen[0] / 24 and seen.sum() == 24
