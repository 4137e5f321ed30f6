"""The launcher rejects bad process counts, unusable data, run directories, backends and checkpoint
paths, and model / data changes against a run's checkpoints, before any rank starts."""
from __future__ import annotations

import os

import pytest
import torch
import yaml

from ndtrain.cli.launch import launch, prepare_checked
from ndtrain.cli.preflight import (
    check_backend,
    check_checkpoint_paths,
    check_resume_compatible,
    check_run_dir_writable,
)
from ndtrain.config import ConfigError, ModelConfig, load_config, save_config


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


# ---- pre-start checks (ndtrain.cli.preflight): one ConfigError line before any rank starts ----

def _fake_run_dir(path, cfg) -> None:
    """A run directory as the trainer leaves it: its config.yaml and one complete checkpoint."""
    (path / "checkpoints" / "step_00000005").mkdir(parents=True)
    save_config(cfg, path / "config.yaml")


def test_changed_model_or_data_is_refused_on_resume_and_config_kept(tmp_path):
    run = tmp_path / "run"
    _fake_run_dir(run, load_config("debug"))
    saved = (run / "config.yaml").read_text()
    changed = load_config("debug", {"model.dim": 128, "data.tokenizer": "bytes"})
    with pytest.raises(ConfigError) as info:
        check_resume_compatible(changed, run)
    msg = str(info.value)
    assert "model.dim (64 -> 128)" in msg and "data.tokenizer ('bpe' -> 'bytes')" in msg
    assert "n_layers" not in msg and "\n" not in msg
    with pytest.raises(ConfigError, match="model.dim"):  # through launch: refused before anything runs
        launch(changed, run, 1)
    assert (run / "config.yaml").read_text() == saved


def test_training_keys_may_change_on_resume_and_fresh_dirs_accept_anything(tmp_path):
    run = tmp_path / "run"
    _fake_run_dir(run, load_config("debug"))
    check_resume_compatible(load_config("debug", {"training.steps": 50, "training.lr": 1e-3,
                                                  "logging.log_every": 1, "checkpoint.every": 5,
                                                  "data.cache_dir": str(tmp_path / "c")}), run)
    (run / "checkpoints" / "step_00000005").rmdir()  # no checkpoint: nothing to stay compatible with
    check_resume_compatible(load_config("debug", {"model.dim": 128}), run)


def test_key_missing_from_an_older_config_counts_as_its_default(tmp_path):
    run = tmp_path / "run"
    _fake_run_dir(run, load_config("debug"))
    tree = yaml.safe_load((run / "config.yaml").read_text())
    del tree["model"]["rope_theta"]  # debug sets 10000.0; the default is 500000.0
    tree["model"]["retired_key"] = 1  # a key this ndtrain no longer has is ignored
    (run / "config.yaml").write_text(yaml.safe_dump(tree))
    with pytest.raises(ConfigError, match=r"changed: model.rope_theta \(500000.0 -> 10000.0\)\. "):
        check_resume_compatible(load_config("debug"), run)  # the only difference: retired_key ignored
    check_resume_compatible(load_config("debug", {"model.rope_theta": ModelConfig().rope_theta}), run)


def test_unwritable_run_dir(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"--run-dir .*file/run: .*file is not a directory"):
        check_run_dir_writable(tmp_path / "file" / "run")
    check_run_dir_writable(tmp_path / "new" / "deeper")  # created later by the trainer
    assert not (tmp_path / "new").exists()  # the check leaves nothing behind


def test_read_only_run_dir(tmp_path, monkeypatch):
    """A folder the probe file cannot be created in. root may write into a 0o500 folder, so as root
    the refusal a read-only mount would give is injected at the probe (the same OSError path)."""
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    if os.geteuid() == 0:
        def refuse(*_a, **_k):
            raise PermissionError(13, "Permission denied")

        monkeypatch.setattr("ndtrain.cli.preflight.tempfile.TemporaryFile", refuse)
    with pytest.raises(ConfigError, match=r"cannot write in .*ro \(Permission denied\)"):
        check_run_dir_writable(ro / "run")


def test_missing_checkpoint_paths(tmp_path):
    cfg = load_config("debug", {"checkpoint.load_from": str(tmp_path / "nope")})
    with pytest.raises(ConfigError, match=r"^checkpoint.load_from: .*nope does not exist$"):
        check_checkpoint_paths(cfg)
    if hasattr(cfg.checkpoint, "init_weights_from"):
        cfg = load_config("debug", {"checkpoint.init_weights_from": str(tmp_path / "hf")})
        with pytest.raises(ConfigError, match=r"^checkpoint.init_weights_from: .*hf does not exist$"):
            check_checkpoint_paths(cfg)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_nccl_and_cuda_need_cuda():
    with pytest.raises(ConfigError, match=r"^parallel.backend=nccl needs CUDA GPUs"):
        check_backend(load_config("debug", {"parallel.backend": "nccl"}), 2)
    with pytest.raises(ConfigError, match=r"^training.device=cuda but no CUDA device"):
        check_backend(load_config("debug", {"training.device": "cuda"}), 1)
    check_backend(load_config("debug", {"parallel.backend": "gloo"}), 2)


def test_existing_path_that_is_not_a_checkpoint(tmp_path):
    """A path that exists but is not a checkpoint (a file, a run directory, a checkpoints/ folder)
    is one line before launch; a step folder (meta.json) or, for init_weights_from, a Hugging Face
    folder (config.json) passes."""
    (tmp_path / "file").write_text("x")
    step = tmp_path / "run" / "checkpoints" / "step_00000002"
    step.mkdir(parents=True)
    for src in (tmp_path / "file", tmp_path / "run", step.parent):
        for key in ("load_from", "init_weights_from"):
            cfg = load_config("debug", {f"checkpoint.{key}": str(src)})
            with pytest.raises(ConfigError, match=rf"^checkpoint.{key}: .* is not an ndtrain checkpoint folder"):
                check_checkpoint_paths(cfg)
    (step / "meta.json").write_text("{}")
    check_checkpoint_paths(load_config("debug", {"checkpoint.load_from": str(step)}))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    check_checkpoint_paths(load_config("debug", {"checkpoint.init_weights_from": str(hf)}))
    with pytest.raises(ConfigError, match="is not an ndtrain checkpoint folder"):
        check_checkpoint_paths(load_config("debug", {"checkpoint.load_from": str(hf)}))


def test_yaml_whose_top_level_is_not_a_mapping(tmp_path):
    bad = tmp_path / "list.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must be a mapping of sections"):
        load_config(str(bad))


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  dim: 64\n  n_layers: [2\ntraining:\n  steps: 3\n")
    with pytest.raises(ConfigError, match=rf"^{bad}:\d+: YAML syntax error: ") as info:
        load_config(str(bad))
    line = int(str(info.value).split(":")[1])
    assert line in (3, 4)  # the unclosed list opens on line 3; the parser notices on line 4


def test_yaml_key_given_twice_is_an_error_naming_its_line(tmp_path):
    """A repeated section or key would silently win over the first (plain YAML keeps the last)."""
    bad = tmp_path / "dup.yaml"
    bad.write_text("training:\n  steps: 3\ncheckpoint:\n  every: 2\ncheckpoint:\n  every: 5\n")
    with pytest.raises(ConfigError, match=rf"^{bad}:5: YAML syntax error: key 'checkpoint' appears twice"):
        load_config(str(bad))
    nested = tmp_path / "nested.yaml"
    nested.write_text("training:\n  steps: 3\n  steps: 4\n")
    with pytest.raises(ConfigError, match=rf"^{nested}:3: .*key 'steps' appears twice"):
        load_config(str(nested))
