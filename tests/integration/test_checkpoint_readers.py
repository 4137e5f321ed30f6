"""Every reader of a checkpoint verifies it: ``generate``, ``eval``, ``convert --to-hf`` and
``checkpoint.init_weights_from`` refuse a damaged checkpoint (4 bytes overwritten, a file truncated
to 100 KB) with one line naming the file and what failed, and a non-zero exit code; nothing is
written. A folder without a manifest (older format) that DCP cannot read is one line too, not a raw
EOFError."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from ndtrain.checkpoint import dcp as ckpt
from ndtrain.cli.commands import main
from ndtrain.config import load_config
from ndtrain.data import prepare_data
from ndtrain.train.loop import run
from tests.corpus import source_text

STEP_DIR = "checkpoints/step_00000002"
SHARD = "__0_0.distcp"


def _cfg(tmp: Path, **over):
    corpus = tmp / "corpus.txt"
    if not corpus.exists():
        corpus.write_text(source_text(20000))
    base = {"data.source": str(corpus), "data.tokenizer": "bytes", "data.cache_dir": str(tmp / "cache"),
            "training.steps": 2, "checkpoint.every": 2, "training.eval_every": 0,
            "training.sample_tokens": 0, "logging.plot": False}
    base.update(over)
    return load_config("debug", base, world_size=1)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("readers")
    torch.set_num_threads(1)
    cfg = _cfg(tmp)
    run(cfg, tmp / "run", prepare_data(cfg.data, cfg.model.vocab_size))
    assert (tmp / "run" / STEP_DIR / SHARD).stat().st_size > 100_000
    return tmp


def _overwrite4(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        old = f.read(4)
        f.seek(-4, 1)
        f.write(bytes(b ^ 0xFF for b in old))


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(100_000)


def _damaged(trained: Path, name: str, damage, keep_manifest: bool = True) -> Path:
    rd = trained / name
    shutil.copytree(trained / "run", rd)
    damage(rd / STEP_DIR / SHARD)
    if not keep_manifest:
        (rd / STEP_DIR / "manifest.json").unlink()
    return rd


CASES = [("overwrite4", _overwrite4, True, f"{SHARD}: checksum mismatch (corrupted)"),
         ("truncate", _truncate, True, f"{SHARD}: 100000 bytes, manifest says"),
         ("nomanifest", _truncate, False, "unreadable checkpoint (EOFError: a file ends early)")]


@pytest.mark.parametrize("name,damage,keep,why", CASES, ids=[c[0] for c in CASES])
def test_after_training_commands_refuse_a_damaged_checkpoint(trained, capsys, name, damage, keep, why):
    rd = _damaged(trained, name, damage, keep)
    commands = [["generate", "--run-dir", rd, "--prompt", "def", "--max-new-tokens", "2"],
                ["eval", "--run-dir", rd, "--batches", "1", "--json", rd / "eval.json"],
                ["convert", "--run-dir", rd, "--to-hf", rd / "hf"]]
    for argv in commands:
        capsys.readouterr()
        rc = main([str(a) for a in argv])
        out = capsys.readouterr()
        lines = out.err.strip().splitlines()
        assert rc == 2 and len(lines) == 1, (argv[0], rc, out.err)
        assert lines[0].startswith(f"ndtrain {argv[0]}: checkpoint={rd / STEP_DIR}: "), lines[0]
        assert why in lines[0], lines[0]
        assert out.out == ""  # no loss printed, no text generated
    assert not (rd / "hf").exists() and not (rd / "eval.json").exists()


@pytest.mark.parametrize("damage", [_overwrite4, _truncate], ids=["overwrite4", "truncate"])
def test_init_weights_from_refuses_a_damaged_checkpoint(trained, damage):
    rd = _damaged(trained, f"init_{damage.__name__}", damage)
    cfg = _cfg(trained, **{"checkpoint.init_weights_from": str(rd / STEP_DIR), "training.steps": 1})
    with pytest.raises(ckpt.CheckpointDamagedError) as err:
        run(cfg, trained / f"fine_{damage.__name__}", prepare_data(cfg.data, cfg.model.vocab_size))
    assert str(err.value).startswith(f"checkpoint.init_weights_from={rd / STEP_DIR}: the checkpoint is "
                                     f"damaged ({SHARD}: ")
    assert len(str(err.value).splitlines()) == 1


def test_non_finite_weights_are_refused(trained, capsys):
    """A checkpoint whose manifest matches but whose weights are NaN (saved from a broken run, or
    a folder without a manifest) is refused before any output."""
    rd = trained / "nan"
    shutil.copytree(trained / "run", rd)
    from ndtrain.train.rundir import RunDir, build_empty_model

    model = build_empty_model(RunDir.open(rd).cfg)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    for v in sd.values():
        v.fill_(0.5)
    sd["norm.weight"][3] = float("nan")
    shutil.rmtree(rd / STEP_DIR)
    ckpt.save_checkpoint(rd / "checkpoints", 2, {"model": sd}, {"step": 2})
    capsys.readouterr()
    rc = main(["convert", "--run-dir", str(rd), "--to-hf", str(rd / "hf")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == (f"ndtrain convert: checkpoint={rd / STEP_DIR}: the checkpoint is damaged "
                               "(1 tensors hold NaN / inf, e.g. norm.weight)")
    assert not (rd / "hf").exists()
