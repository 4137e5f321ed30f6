"""The launcher rejects bad process counts and unusable data before any rank starts."""
from __future__ import annotations

import pytest

from ndtrain.config import ConfigError, load_config
from ndtrain.launch import launch, prepare_checked


@pytest.mark.parametrize("nproc", [0, -1])
def test_nproc_must_be_positive(tmp_path, nproc):
    cfg = load_config("debug")
    with pytest.raises(ConfigError, match=rf"--nproc \({nproc}\) must be >= 1"):
        launch(cfg, tmp_path / "run", nproc)
    assert not (tmp_path / "run").exists()


def test_corpus_too_small_for_one_sequence(tmp_path):
    (tmp_path / "tiny.txt").write_text("def f():\n    return 1\n" * 20)  # ~480 bytes
    cfg = load_config("debug", {"data.source": str(tmp_path / "tiny.txt"), "data.tokenizer": "bytes",
                                "data.cache_dir": str(tmp_path / "cache")})
    with pytest.raises(ConfigError, match=r"data: the val split has \d+ tokens, fewer than one sequence"):
        prepare_checked(cfg)


def test_data_errors_become_config_errors(tmp_path):
    cfg = load_config("debug", {"data.source": str(tmp_path / "nothing-*.parquet"),
                                "data.cache_dir": str(tmp_path / "cache")})
    with pytest.raises(ConfigError, match="data: .*matched no files"):
        prepare_checked(cfg)
