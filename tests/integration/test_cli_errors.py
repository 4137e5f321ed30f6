"""``ndtrain train`` fails with one clear line (exit code 2) before any process starts, for setups
that used to print a traceback from every worker; refuses a model / data change on resume without
touching the run's config.yaml; and a SIGINT to the launcher alone stops every worker quietly."""
from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.corpus import source_text
from tests.dist_utils import is_alive, live_descendants

ROOT = Path(__file__).resolve().parents[2]


def _corpus(tmp_path: Path) -> Path:
    text = source_text(60000)
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    return path


def _data_args(tmp_path: Path) -> list[str]:
    return [f"--data.source={_corpus(tmp_path)}", "--data.tokenizer=bytes",
            f"--data.cache_dir={tmp_path / 'cache'}"]


def _train(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ndtrain.cli.commands", "train", *args], check=False, capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def _assert_one_line_error(proc: subprocess.CompletedProcess, pattern: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out and proc.stdout == "", out
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and re.fullmatch(pattern, lines[0]), out


def test_unwritable_run_dir(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    proc = _train("--config", "debug", "--nproc", "2", f"--run-dir={tmp_path / 'file' / 'run'}")
    _assert_one_line_error(proc, r"ndtrain: invalid config: --run-dir .*/file/run: .*/file is not a directory")


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  dim: 64\n  n_heads: 4\n  n_layers: [2\ntraining:\n  steps: 3\n")
    proc = _train("--config", str(bad), "--nproc", "2", f"--run-dir={tmp_path / 'run'}")
    _assert_one_line_error(proc, rf"ndtrain: invalid config: {re.escape(str(bad))}:[45]: YAML syntax error: .+")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_nccl_without_cuda(tmp_path):
    proc = _train("--config", "debug", "--nproc", "2", "--parallel.backend=nccl", f"--run-dir={tmp_path / 'run'}")
    _assert_one_line_error(proc, r"ndtrain: invalid config: parallel.backend=nccl needs CUDA GPUs, .+")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("key", ["load_from", "init_weights_from"])
def test_missing_checkpoint_path(tmp_path, key):
    from ndtrain.config import CheckpointConfig

    if not hasattr(CheckpointConfig(), key):
        pytest.skip(f"checkpoint.{key} is not a config key here")
    missing = tmp_path / "no-such-checkpoint"
    proc = _train("--config", "debug", "--nproc", "2", f"--checkpoint.{key}={missing}",
                  f"--run-dir={tmp_path / 'run'}")
    _assert_one_line_error(proc, rf"ndtrain: invalid config: checkpoint.{key}: {re.escape(str(missing))} "
                                 r"does not exist")


def test_fine_tune_from_a_checkpoint_of_another_shape(tmp_path):
    """Before: every rank's traceback from DCP's load. Now the shapes are read from the checkpoint's
    metadata before any process starts."""
    from ndtrain.checkpoint.dcp import save_checkpoint
    from ndtrain.config import load_config, save_config
    from ndtrain.model import Transformer

    narrow = load_config("debug", {"model.dim": 32})
    (tmp_path / "a").mkdir()
    save_config(narrow, tmp_path / "a" / "config.yaml")
    path = save_checkpoint(tmp_path / "a" / "checkpoints", 2, {"model": Transformer(narrow.model).state_dict()},
                           {"step": 2})
    proc = _train("--config", "debug", "--nproc", "2", f"--checkpoint.init_weights_from={path}",
                  f"--run-dir={tmp_path / 'run'}")
    _assert_one_line_error(proc, re.escape(
        f"ndtrain: invalid config: checkpoint.init_weights_from: {path} holds another model: "
        "tok_embeddings.weight is (512, 32) there, (512, 64) in this model (model.dim: 32 there, 64 here); "
        "set the model keys to the checkpoint's, or start from another checkpoint"))
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # three runs of the CLI: ~20 s on an idle 2-core machine
def test_changed_model_on_resume_is_refused_and_config_kept(tmp_path):
    run = tmp_path / "run"
    common = ["--config", "debug", "--nproc", "1", f"--run-dir={run}", *_data_args(tmp_path),
              "--training.steps=2", "--checkpoint.every=2", "--training.eval_every=0",
              "--training.sample_tokens=4"]
    first = _train(*common)
    assert first.returncode == 0, first.stdout + first.stderr
    saved = (run / "config.yaml").read_text()
    proc = _train(*common, "--model.dim=32", "--data.seq_len=16")
    _assert_one_line_error(proc, r"ndtrain: invalid config: --run-dir .* holds checkpoints of another model / "
                                 r"data; changed: model.dim \(64 -> 32\), data.seq_len \(32 -> 16\)\. .+")
    assert (run / "config.yaml").read_text() == saved
    # training keys may change: the same run resumes
    more = _train(*common[:-3], "--training.steps=3", "--training.eval_every=0", "--training.sample_tokens=4")
    assert more.returncode == 0, more.stdout + more.stderr
    assert "resumed from" in more.stdout


def _kill_left(pids: set[int], grace_s: float) -> list[int]:
    """Wait up to ``grace_s`` for ``pids`` to exit; SIGKILL and return those still alive."""
    deadline = time.monotonic() + grace_s
    while any(is_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in pids if is_alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    return left


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc")
def test_sigint_to_launcher_stops_all_workers(tmp_path):
    """Before: a SIGINT to the launcher alone printed a traceback and left both ranks training."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ndtrain.cli.commands", "train", "--config", "debug", "--nproc", "2",
         f"--run-dir={tmp_path / 'run'}", *_data_args(tmp_path), "--training.steps=1000000",
         "--logging.log_every=1", "--training.eval_every=0", "--logging.plot=true"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    workers: set[int] = set()
    try:
        deadline = time.monotonic() + 240
        out = []
        while time.monotonic() < deadline:  # rank 0 prints its first metrics line once both train
            line = proc.stdout.readline()
            out.append(line)
            if not line or line.startswith("step"):
                break
        assert line.startswith("step"), "".join(out) + proc.stderr.read()
        workers = live_descendants(proc.pid)
        assert len(workers) >= 2, workers  # the two ranks (and multiprocessing's resource tracker)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        time.sleep(0.1)
        left_running = _kill_left(workers, grace_s=10)  # a failing test must not leave ranks training
    assert not left_running, f"workers {left_running} still ran 10 s after the launcher exited"
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stdout + stderr, stderr
    assert stderr.strip().splitlines()[-1] == "ndtrain: interrupted; all ranks stopped", stderr
    assert (tmp_path / "run" / "loss.png").stat().st_size > 0  # drawn by the launcher after the stop
    assert not (tmp_path / "run" / "ndtrain.lock").exists()  # released on the way out


def _start_training(tmp_path: Path, run: Path, *extra: str) -> tuple[subprocess.Popen, list[str]]:
    """A long single-process training into ``run``, returned once it printed its first step line."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ndtrain.cli.commands", "train", "--config", "debug", "--nproc", "1",
         f"--run-dir={run}", *_data_args(tmp_path), "--training.steps=1000000", "--logging.log_every=1",
         "--training.eval_every=0", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    out, deadline = [], time.monotonic() + 240
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        out.append(line)
        if not line or line.startswith("step"):
            break
    return proc, out


@pytest.mark.slow  # two CLI runs: ~15 s on an idle 2-core machine
def test_second_training_into_a_busy_run_dir_is_refused(tmp_path):
    """Before: both trained, and every metrics row appeared twice."""
    run = tmp_path / "run"
    first, out = _start_training(tmp_path, run)
    try:
        assert out[-1].startswith("step"), "".join(out) + first.stderr.read()
        second = _train("--config", "debug", "--nproc", "1", f"--run-dir={run}", *_data_args(tmp_path))
        first.send_signal(signal.SIGINT)
        first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    _assert_one_line_error(second, re.escape(f"ndtrain: run dir {run} in use by pid {first.pid}; wait for "
                                             "that training to end, stop it, or pass another --run-dir"))
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps))  # one row per step
    assert not (run / "ndtrain.lock").exists()


@pytest.mark.slow  # two CLI runs of 2 ranks: ~30 s on an idle 2-core machine
def test_full_disk_during_training_is_one_line_and_keeps_the_last_checkpoint(tmp_path):
    """The disk is "full" for the second run: a file-size limit (RLIMIT_FSIZE, which Python turns
    into EFBIG) lets the small files through and stops the first checkpoint shard."""
    import resource

    from ndtrain.checkpoint.integrity import verify

    run = tmp_path / "run"
    common = ["--config", "debug", "--nproc", "2", f"--run-dir={run}", *_data_args(tmp_path),
              "--training.steps=4", "--checkpoint.every=2", "--training.eval_every=0", "--training.sample_tokens=4"]
    first = _train(*common, "--training.stop_at_step=2")
    assert first.returncode == 0, first.stdout + first.stderr
    good = run / "checkpoints" / "step_00000002"
    before = {p.name: p.read_bytes() for p in good.iterdir()}
    limit = 200_000  # bytes per file: config, metrics, logs fit; a checkpoint shard of the debug model does not
    assert max(len(b) for b in before.values()) > limit
    proc = subprocess.run([sys.executable, "-m", "ndtrain.cli.commands", "train", *common], check=False,
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    assert proc.stderr.splitlines() == [
        (f"ndtrain: cannot write {run / 'checkpoints' / 'step_00000004.tmp'}: {os.strerror(errno.EFBIG)}; "
         "the last good checkpoint step_00000002 is kept")], proc.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002"]
    assert verify(good) is None and {p.name: p.read_bytes() for p in good.iterdir()} == before
