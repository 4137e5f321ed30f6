"""Discoverable configuration and the stable run directory, through ``ndtrain.cli.commands.main`` in process.

``--print-config``, ``config keys`` (checked against a synthetic schema source too, so the comment
parser is tested on cases the real schema may not contain), did-you-mean on keys / sections /
presets, ``--version`` (one source: package metadata = pyproject.toml), and a real two-step
``debug`` run in ``runs/debug`` that a re-run reports as finished (exit 0) without training.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import re
from pathlib import Path

import pytest
import yaml

from ndtrain import __version__
from ndtrain.cli.commands import main
from ndtrain.config import Config, load_config
from ndtrain.config.keys import config_keys, format_keys

ROOT = Path(__file__).resolve().parents[2]


def test_print_config_is_the_resolved_config_and_trains_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--config", "debug", "--print-config", "--training.steps=7", "--model.dim=32"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    expected = load_config("debug", {"training.steps": "7", "model.dim": "32"}).to_dict()
    assert printed == expected and printed["training"]["steps"] == 7 and printed["model"]["dim"] == 32
    assert not (tmp_path / "runs").exists()


def test_print_config_still_validates(capsys):
    assert main(["train", "--config", "debug", "--print-config", "--model.n_heads=3"]) == 2
    assert "invalid config: dim (64) is not divisible by n_heads (3)" in capsys.readouterr().err


def test_config_keys_lists_every_field_with_default_and_comment(capsys):
    assert main(["config", "keys"]) == 0
    out = capsys.readouterr().out
    cfg = Config()
    n = 0
    for section in dataclasses.fields(cfg):
        for f in dataclasses.fields(getattr(cfg, section.name)):
            n += 1
            default = getattr(getattr(cfg, section.name), f.name)
            assert re.search(rf"^{section.name}\.{f.name} = {re.escape(repr(default))} +# \S", out, re.MULTILINE), \
                f"{section.name}.{f.name} missing or undocumented"
    assert len(out.strip().splitlines()) == n + len(dataclasses.fields(cfg)) - 1  # a blank line between sections
    assert "training.steps = 100" in out and "# optimizer steps (the LR schedule spans these)" in out


def test_config_keys_section_filter_and_typo(capsys):
    assert main(["config", "keys", "--section", "checkpoint"]) == 0
    out = capsys.readouterr().out
    assert {line.split(" ")[0] for line in out.splitlines()} == {
        f"checkpoint.{f.name}" for f in dataclasses.fields(Config().checkpoint)}
    assert main(["config", "keys", "--section", "checkpont"]) == 2
    assert "unknown config section 'checkpont' (did you mean 'checkpoint'?)" in capsys.readouterr().err


def test_comment_parser_on_a_synthetic_schema(tmp_path):
    """Comments are read per field line by tokenize: a ``#`` inside a string default is not a
    comment, a field without a comment gets "", a multi-line default takes the comment on its
    last line, and a class not in ``Config`` is ignored."""
    src = tmp_path / "schema.py"
    src.write_text(
        "class ModelConfig:\n"
        "    name: str = 'a # b'  # the name\n"
        "    dim: int = 256\n"
        "    n_layers: int = (\n"
        "        4)  # blocks\n"
        "class Unrelated:\n"
        "    x: int = 1  # not a config field\n")
    keys = {k.key: k for k in config_keys(src) if k.key.startswith("model.")}
    assert keys["model.name"].comment == "the name"
    assert keys["model.dim"].comment == ""
    assert keys["model.n_layers"].comment == "blocks"
    assert keys["model.vocab_size"].comment == ""  # in Config, absent from this source
    text = format_keys([keys["model.name"], keys["model.dim"]])
    assert text.splitlines() == ["model.name = 'llama'  # the name", "model.dim = 256"]


@pytest.mark.parametrize("override, message", [
    ("--training.step=3", "unknown config key 'training.step' (did you mean 'training.steps'?)"),
    ("--trainig.steps=3", "unknown config section 'trainig' (in 'trainig.steps') (did you mean 'training.steps'?)"),
    ("--model.n_head=3", "unknown config key 'model.n_head' (did you mean 'model.n_heads'?)"),
    ("--training.zzzz=3", "unknown config key 'training.zzzz'; `ndtrain config keys` lists every key"),
])
def test_did_you_mean_on_keys_and_sections(override, message, capsys):
    assert main(["train", "--config", "debug", "--print-config", override]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_did_you_mean_on_presets(capsys):
    assert main(["train", "--config", "lama3_8b", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "config 'lama3_8b' is neither a file nor a preset (did you mean 'llama3_8b'?)" in err


@pytest.mark.parametrize("flag, suggestion", [("--nprocs", "--nproc"), ("--run_dir=x", "--run-dir"),
                                             ("--print_config", "--print-config")])
def test_did_you_mean_on_train_flags(flag, suggestion, capsys):
    assert main(["train", "--config", "debug", flag, "2"]) == 2
    err = capsys.readouterr().err
    assert f"unexpected argument {flag!r} (did you mean {suggestion!r}?)" in err
    assert len(err.strip().splitlines()) == 1


def test_pipeline_settings_without_a_pipeline_are_noted():
    """pp = 1 runs one stage whatever the schedule: a non-default schedule or virtual stage count
    is named as having no effect (printed before training), never silently dropped."""
    from ndtrain.parallel.pp.rules import inert_settings

    assert inert_settings(2, "dualpipev", 1) == [] and inert_settings(1, "1f1b", 1) == []
    notes = inert_settings(1, "interleaved", 2)
    assert len(notes) == 2 and "pp_schedule=interleaved has no effect with pp=1" in notes[0]
    assert "pp_virtual_stages=2" in notes[1]


def test_version_single_source(capsys):
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert __version__ == importlib.metadata.version("ndtrain") == declared
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"ndtrain {declared}\n"


def test_every_preset_checkpoints_by_default():
    from ndtrain.config import CONFIG_DIR

    for path in sorted(CONFIG_DIR.glob("*.yaml")):
        tree = yaml.safe_load(path.read_text())
        every = (tree.get("checkpoint") or {}).get("every", 0)
        steps = (tree.get("training") or {}).get("steps", Config().training.steps)
        assert 0 < every <= steps, f"{path.name}: checkpoint.every={every} with {steps} steps"


def test_default_run_dir_is_stable_and_a_finished_run_says_so(tmp_path, monkeypatch, capsys):
    """``runs/<preset>`` by default; the same command again exits 0 with one line and trains
    nothing; fewer steps than the checkpoint is a one-line config error (exit 2); more resumes."""
    from ndtrain.cli.rerun import default_run_dir

    assert default_run_dir("debug") == Path("runs/debug")
    assert default_run_dir("configs/my_run.yaml") == Path("runs/my_run")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    (tmp_path / "corpus.txt").write_text("".join(p.read_text() for p in sorted((ROOT / "ndtrain").glob("*.py")))[:40000])
    args = ["train", "--config", "debug", "--data.source=corpus.txt", "--data.tokenizer=bytes",
            f"--data.cache_dir={tmp_path / 'cache'}", "--training.eval_batches=1", "--training.sample_tokens=4",
            "--logging.log_every=1", "--checkpoint.every=2", "--logging.progress=plain"]
    assert main(args + ["--training.steps=2"]) == 0
    first = capsys.readouterr().out
    run = tmp_path / "runs" / "debug"
    assert (run / "checkpoints").is_dir() and "run dir: runs/debug" in first
    assert re.search(r"^step     2 \| loss .* \| elapsed \d+:\d\d \| eta 0:00$", first, re.MULTILINE)
    assert re.search(r"^sample:\n", first, re.MULTILINE) and "sample: '" not in first  # text, not a repr
    log = (run / "console.log").read_text()
    assert "layout single (world 1)" in log and re.search(r"^step     2 \| loss", log, re.MULTILINE)
    rows_before = (run / "metrics.jsonl").read_text()

    assert main(args + ["--training.steps=2"]) == 0
    again = capsys.readouterr().out
    assert again == ("ndtrain: runs/debug already finished (checkpoint at step 2 = training.steps); "
                     "nothing to train. Raise --training.steps to continue, or pass another --run-dir\n")
    assert (run / "metrics.jsonl").read_text() == rows_before

    assert main(args + ["--training.steps=1"]) == 2
    err = capsys.readouterr().err
    assert "its newest checkpoint is at step 2, past training.steps (1)" in err and len(err.splitlines()) == 1

    assert main(args + ["--training.steps=3", "--training.stop_at_step=2"]) == 0
    assert "already reached training.stop_at_step (2" in capsys.readouterr().out


def test_a_damaged_newest_checkpoint_does_not_make_a_run_look_finished(tmp_path):
    """The finished check follows the resume: the newest checkpoint that verifies decides. With the
    final checkpoint's shard damaged, the run resumes from step 5 (not "already finished")."""
    import json

    from ndtrain.checkpoint.integrity import write_manifest
    from ndtrain.cli.rerun import finished_message
    from ndtrain.config import load_config

    for step in (5, 10):
        folder = tmp_path / "checkpoints" / f"step_{step:08d}"
        folder.mkdir(parents=True)
        (folder / "meta.json").write_text(json.dumps({"step": step}))
        (folder / ".metadata").write_bytes(b"dcp")
        (folder / "__0_0.distcp").write_bytes(bytes(range(64)))
        write_manifest(folder)
    cfg = load_config("debug", {"training.steps": 10})
    assert "already finished" in finished_message(cfg, tmp_path)
    (tmp_path / "checkpoints" / "step_00000010" / "__0_0.distcp").write_bytes(bytes(64))
    assert finished_message(cfg, tmp_path) is None
