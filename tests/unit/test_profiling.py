"""``ndtrain train --profile-steps A:B``: the window parser and a real 1-process run's Chrome trace.

The run trains the ``debug`` model for 4 steps in this process through ``ndtrain.cli.commands.main`` and
profiles steps 2..3; the trace must be valid JSON in Chrome trace format holding exactly the two
``ProfilerStep#N`` ranges of the window (a trace of the wrong steps, or none, fails) and operator
events (``aten::mm`` of the model's projections) inside them.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ndtrain.cli.commands import main
from ndtrain.config.validate import parse_profile_steps
from ndtrain.errors import ConfigError
from ndtrain.train.profiling import StepProfiler, trace_path


def test_parse_profile_steps():
    assert parse_profile_steps("") is None
    assert parse_profile_steps("2:3") == (2, 3)
    assert parse_profile_steps("5:5") == (5, 5)
    for bad in ("3", "3:2", "0:1", "a:b", "1:2:3", ":4"):
        with pytest.raises(ConfigError, match="logging.profile_steps"):
            parse_profile_steps(bad)


def test_bad_window_is_a_config_error_before_training(tmp_path, capsys):
    assert main(["train", "--config", "debug", "--run-dir", str(tmp_path / "r"), "--profile-steps", "4:2"]) == 2
    assert "logging.profile_steps" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_window_past_the_last_step_is_written_at_close(tmp_path):
    prof = StepProfiler("2:9", tmp_path, 0, "cpu")
    for step in (1, 2, 3):
        prof.begin(step)
        torch.ones(4) @ torch.ones(4)
        prof.end(step)
    assert prof.path is None  # still recording: step 9 not reached
    prof.close()
    names = {e.get("name") for e in json.loads(prof.path.read_text())["traceEvents"]}
    assert {"ProfilerStep#2", "ProfilerStep#3"} <= names and "ProfilerStep#1" not in names


def test_train_profile_writes_chrome_trace(tmp_path):
    torch.set_num_threads(1)
    corpus = tmp_path / "corpus.txt"
    src = Path(__file__).resolve().parents[2] / "ndtrain"
    corpus.write_text("\n".join(p.read_text() for p in sorted(src.glob("*.py")))[:40000])
    run_dir = tmp_path / "run"
    rc = main(["train", "--config", "debug", "--run-dir", str(run_dir), "--profile-steps", "2:3",
               f"--data.source={corpus}", "--data.tokenizer=bytes", f"--data.cache_dir={tmp_path / 'cache'}",
               "--training.steps=4", "--training.eval_every=0", "--checkpoint.every=0",
               "--training.sample_tokens=2", "--logging.log_every=1", "--logging.plot=false"])
    assert rc == 0
    path = trace_path(run_dir, (2, 3), 0)
    assert path.name == "trace_steps_2-3_rank_0.json" and path.parent == run_dir / "profile"
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    steps = sorted(e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#"))
    assert steps == ["ProfilerStep#2", "ProfilerStep#3"]
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") in steps]
    mms = [e for e in events if e.get("name") in ("aten::mm", "aten::addmm", "aten::linear") and "ts" in e]
    assert mms and all(any(a <= e["ts"] <= b for a, b in spans) for e in mms)
    assert any(e.get("args", {}).get("Input Dims") for e in mms)  # record_shapes
