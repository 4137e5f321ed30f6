"""A tiny trained run directory for the evaluation tests: the debug model on raw bytes (the split of a
context and its continuation into tokens is then plain byte arithmetic), max_seq_len 24 so rolling
windows and left truncation are exercised, 2 steps on one process, the checkpoint of step 2. The
weights start at std 0.5, not 0.02, so that greedy text varies with the context (two steps from a
near-uniform start generate nothing but spaces, which no stop string or exact match tells apart)."""
from __future__ import annotations

from pathlib import Path

from ndtrain.cli.launch import launch
from ndtrain.config import load_config
from tests.corpus import source_text

SEQ, MAX_LEN = 16, 24


def tiny_run_dir(tmp: Path, **over) -> Path:
    """Train the run in ``tmp / "run"`` (corpus and cache under ``tmp``) and return its path."""
    (tmp / "corpus.txt").write_text(source_text(8000))
    cfg = load_config("debug", {"data.source": str(tmp / "corpus.txt"), "data.cache_dir": str(tmp / "cache"),
                                "data.tokenizer": "bytes", "data.seq_len": SEQ, "model.max_seq_len": MAX_LEN,
                                "model.init_std": 0.5, "training.steps": 2, "checkpoint.every": 2, "training.sample_tokens": 0,
                                "logging.progress": "plain", **over}, world_size=1)
    launch(cfg, tmp / "run", nproc=1)
    return tmp / "run"
