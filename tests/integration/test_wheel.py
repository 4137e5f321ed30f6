"""A wheel of ndtrain ships its presets: built from a copy of the sources, installed into a
temporary target, ``ndtrain train --config debug`` runs one step from another directory."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.corpus import source_text

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # builds and installs a wheel, then trains: ~40 s on 2 cores


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600, **kw)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_wheel_ships_presets_and_trains_debug(tmp_path):
    # Build from a copy: an in-tree build would write build/ and *.egg-info into the working tree.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "ndtrain", src / "ndtrain", ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path / "dist"
    # no network: the build uses this environment's setuptools, and no dependency is fetched
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
          str(src)])
    (wheel,) = dist.glob("ndtrain-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    presets = {Path(n).name for n in names if n.startswith("ndtrain/configs/")}
    assert {"debug.yaml", "default.yaml", "llama3_8b.yaml"} <= presets, names
    target = tmp_path / "site"
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)])

    work = tmp_path / "elsewhere"  # no ndtrain/ or configs/ below the working directory
    work.mkdir()
    corpus = work / "corpus.txt"
    corpus.write_text(source_text(60000))
    env = dict(os.environ, PYTHONPATH=str(target))
    where = _run([sys.executable, "-c", "import ndtrain; print(ndtrain.__file__)"], cwd=work, env=env)
    assert where.stdout.strip() == str(target / "ndtrain" / "__init__.py")  # the wheel, not the repo
    proc = _run([sys.executable, "-m", "ndtrain.cli.commands", "train", "--config", "debug", "--nproc", "1",
                 "--run-dir=run", f"--data.source={corpus}", "--data.tokenizer=bytes",
                 f"--data.cache_dir={work / 'cache'}", "--training.steps=1", "--logging.log_every=1",
                 "--training.sample_tokens=4"], cwd=work, env=env)
    assert "step     1 | loss" in proc.stdout, proc.stdout
    assert (work / "run" / "metrics.jsonl").exists()
