"""Starting from a checkpoint of another shape (``checkpoint.init_weights_from`` / ``load_from``) is
one ConfigError line before launch, read from the DCP metadata or the Hugging Face config.json,
naming the first tensor that differs and the model keys behind it."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from ndtrain.checkpoint.dcp import save_checkpoint
from ndtrain.cli.preflight import check_start_checkpoint_shapes, preflight
from ndtrain.config import ConfigError, load_config, save_config
from ndtrain.model import Transformer


def _checkpoint(run: Path, **model) -> Path:
    """A one-process checkpoint (model tensors only) of the debug model with ``model`` keys changed,
    saved as a run directory holds it (RUN/config.yaml, RUN/checkpoints/step_00000002)."""
    cfg = load_config("debug", {f"model.{k}": v for k, v in model.items()})
    torch.manual_seed(0)
    net = Transformer(cfg.model)
    run.mkdir(parents=True)
    save_config(cfg, run / "config.yaml")
    return save_checkpoint(run / "checkpoints", 2, {"model": net.state_dict()}, {"step": 2})


def test_init_weights_of_another_width_names_the_tensor_and_key(tmp_path):
    path = _checkpoint(tmp_path / "a", dim=32)
    cfg = load_config("debug", {"checkpoint.init_weights_from": str(path)})
    with pytest.raises(ConfigError) as info:
        preflight(cfg, tmp_path / "run", 1)
    assert str(info.value) == (
        f"checkpoint.init_weights_from: {path} holds another model: tok_embeddings.weight is (512, 32) "
        "there, (512, 64) in this model (model.dim: 32 there, 64 here); set the model keys to the "
        "checkpoint's, or start from another checkpoint")


def test_deeper_checkpoint_names_its_first_extra_tensor_and_shallower_the_missing_one(tmp_path):
    deep = _checkpoint(tmp_path / "deep", n_layers=3)
    extra, shape = next((k, tuple(v.shape)) for k, v in
                        Transformer(load_config("debug", {"model.n_layers": 3}).model).state_dict().items()
                        if k.startswith("layers.2."))
    cfg = load_config("debug", {"checkpoint.init_weights_from": str(deep)})
    with pytest.raises(ConfigError, match=re.escape(f"holds another model: its {extra} {shape} has no place in "
                                                    "this model (model.n_layers: 3 there, 2 here)")):
        check_start_checkpoint_shapes(cfg, tmp_path / "run")
    shallow = _checkpoint(tmp_path / "shallow", n_layers=1)
    cfg = load_config("debug", {"checkpoint.load_from": str(shallow)})  # load_from: the same check
    with pytest.raises(ConfigError, match=r"^checkpoint.load_from: .* holds another model: it has no "
                                          r"layers.1.attention_norm.weight \(64,\) \(model.n_layers: 1 there, 2 here\)"):
        check_start_checkpoint_shapes(cfg, tmp_path / "run")


def test_same_shape_passes_and_a_run_resuming_its_own_checkpoint_is_not_checked(tmp_path):
    path = _checkpoint(tmp_path / "a")
    check_start_checkpoint_shapes(load_config("debug", {"checkpoint.init_weights_from": str(path)}),
                                  tmp_path / "run")
    other = _checkpoint(tmp_path / "b", dim=32)
    own = tmp_path / "own"
    (own / "checkpoints" / "step_00000004").mkdir(parents=True)  # resume wins over init_weights_from
    check_start_checkpoint_shapes(load_config("debug", {"checkpoint.init_weights_from": str(other)}), own)
    with pytest.raises(ConfigError, match="holds another model"):
        check_start_checkpoint_shapes(load_config("debug", {"checkpoint.init_weights_from": str(other),
                                                            "checkpoint.resume": False}), own)


def test_hugging_face_folder_of_another_vocabulary_from_config_json_alone(tmp_path):
    """Only config.json is there (no safetensors): the check reads no weight."""
    import json

    from ndtrain.hf.llama import config_to_hf

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(config_to_hf(load_config("debug", {"model.vocab_size": 1024}).model)))
    cfg = load_config("debug", {"checkpoint.init_weights_from": str(hf)})
    with pytest.raises(ConfigError) as info:
        preflight(cfg, tmp_path / "run", 1)
    assert str(info.value) == (
        f"checkpoint.init_weights_from: {hf} holds another model: tok_embeddings.weight is (1024, 64) "
        "there, (512, 64) in this model (model.vocab_size: 1024 there, 512 here); set the model keys to "
        "the checkpoint's, or start from another checkpoint")
    (hf / "config.json").write_text(json.dumps(config_to_hf(load_config("debug").model)))
    preflight(cfg, tmp_path / "run", 1)  # the same model passes (the weights are read after launch)


def test_a_fine_tune_may_drop_the_mtp_head_but_not_keep_one_the_checkpoint_lacks(tmp_path):
    with_mtp = _checkpoint(tmp_path / "mtp", mtp_depth=1)
    check_start_checkpoint_shapes(load_config("debug", {"checkpoint.init_weights_from": str(with_mtp)}),
                                  tmp_path / "run")
    plain = _checkpoint(tmp_path / "plain")
    cfg = load_config("debug", {"checkpoint.init_weights_from": str(plain), "model.mtp_depth": 1})
    with pytest.raises(ConfigError, match=r"holds another model: it has no mtp\.\S+ .*\(model.mtp_depth: 0 there, 1 here\)"):
        check_start_checkpoint_shapes(cfg, tmp_path / "run")


@pytest.mark.parametrize("key", ["init_weights_from", "load_from"])
def test_a_damaged_start_checkpoint_is_one_line_before_launch(tmp_path, key):
    """4 bytes overwritten in a shard: refused by preflight (the launcher's exit 2, no rank starts,
    so neither a restart nor an elastic shrink can follow), naming the key, the folder and the file."""
    from ndtrain.checkpoint.integrity import write_manifest

    path = _checkpoint(tmp_path / "a")
    write_manifest(path)
    shard = next(path.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2: len(data) // 2 + 4] = b"\xff\xff\xff\xff"
    shard.write_bytes(bytes(data))
    cfg = load_config("debug", {f"checkpoint.{key}": str(path)})
    with pytest.raises(ConfigError) as info:
        preflight(cfg, tmp_path / "run", 1)
    assert str(info.value) == (f"checkpoint.{key}={path}: the checkpoint is damaged ({shard.name}: checksum "
                               "mismatch (corrupted))")
    assert not (tmp_path / "run" / "config.yaml").exists()
