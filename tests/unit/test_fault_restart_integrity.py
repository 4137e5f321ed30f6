"""Checkpoint manifests (``ndtrain.checkpoint.integrity``) and the restart supervisor
(``ndtrain.fault.supervisor``), without starting any process."""
from __future__ import annotations

import json

import pytest

from ndtrain.checkpoint.integrity import MANIFEST, file_crc32, verify, write_manifest
from ndtrain.cli.launch import launch
from ndtrain.config import ConfigError, load_config
from ndtrain.events import read_events
from ndtrain.fault.supervisor import note_torchrun_restart, retryable, supervise
from ndtrain.spawn import SpawnError


def _folder(tmp_path):
    d = tmp_path / "step_00000004"
    d.mkdir()
    (d / "__0_0.distcp").write_bytes(bytes(range(256)) * 16)
    (d / ".metadata").write_bytes(b"dcp-metadata")
    (d / "meta.json").write_text(json.dumps({"step": 4}))
    return d


def test_manifest_lists_every_file_with_size_and_crc(tmp_path):
    d = _folder(tmp_path)
    m = write_manifest(d)
    assert sorted(m["files"]) == [".metadata", "__0_0.distcp", "meta.json"]
    assert m["files"]["__0_0.distcp"] == {"bytes": 4096, "crc32": file_crc32(d / "__0_0.distcp")}
    # zlib's CRC-32 of b"123456789" is the standard check value 0xCBF43926
    (tmp_path / "check").write_bytes(b"123456789")
    assert file_crc32(tmp_path / "check") == 0xCBF43926
    assert verify(d) is None


@pytest.mark.parametrize("damage, expected", [
    ("flip", "__0_0.distcp: checksum mismatch (corrupted)"),
    ("truncate", "__0_0.distcp: 4000 bytes, manifest says 4096 (truncated)"),
    ("meta", "meta.json: missing"),
    ("manifest", "manifest.json: unreadable (JSONDecodeError)"),
])
def test_verify_names_the_damaged_file(tmp_path, damage, expected):
    d = _folder(tmp_path)
    write_manifest(d)
    shard = d / "__0_0.distcp"
    if damage == "flip":  # one bit, same size
        data = bytearray(shard.read_bytes())
        data[1000] ^= 0x01
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:4000])
    elif damage == "meta":
        (d / "meta.json").unlink()
    else:
        (d / MANIFEST).write_text('{"files": {')
    assert verify(d) == expected


def test_folder_without_manifest_needs_meta_and_dcp_metadata(tmp_path):
    d = _folder(tmp_path)  # as written before manifests existed
    assert verify(d) is None
    (d / "meta.json").unlink()
    assert verify(d) == "manifest.json: missing (and meta.json missing)"


def _error(message, details="", rank=1, exitcode=None):
    return SpawnError(message, rank=rank, details=details, exitcode=exitcode)


def test_supervisor_restarts_and_logs_each_failure(tmp_path):
    (tmp_path / "checkpoints" / "step_00000006").mkdir(parents=True)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 9)))
    failures = [_error("rank 1 of 2 was killed by SIGKILL (out of memory?)", exitcode=-9),
                _error("rank 0 of 2 failed: RuntimeError: boom", "Traceback ...\nRuntimeError: boom", 0, 1)]
    calls, said = [], []

    def start():
        calls.append(1)
        if failures:
            raise failures.pop(0)

    assert supervise(start, 5, tmp_path, say=said.append) == 2
    assert len(calls) == 3
    ev = read_events(tmp_path, "restart")
    assert [(e["rank"], e["attempt"], e["signal"], e["exit_code"]) for e in ev] == [(1, 1, "SIGKILL", -9), (0, 2, None, 1)]
    assert ev[0]["step"] == 6 and ev[0]["last_step"] == 8 and ev[0]["steps_lost"] == 2
    assert ev[1]["exception"] == "RuntimeError: boom" and ev[1]["max_restarts"] == 5
    assert said[0] == "ndtrain: rank 1 of 2 was killed by SIGKILL (out of memory?); restart 1 of 5 from step 6"


def test_supervisor_gives_up_after_max_restarts(tmp_path):
    def start():
        raise _error("rank 1 of 2 exited with code 3 without a Python error", exitcode=3)

    with pytest.raises(SpawnError, match="exited with code 3"):
        supervise(start, 2, tmp_path, say=lambda _: None)
    assert [e["attempt"] for e in read_events(tmp_path, "restart")] == [1, 2]
    [failed] = read_events(tmp_path, "failed")
    assert (failed["restarts"], failed["retryable"], failed["rank"]) == (2, True, 1)


@pytest.mark.parametrize("last_line", [
    "ndtrain.errors.ConfigError: tp (3) does not divide n_heads (4)",
    "ndtrain.checkpoint.integrity.CheckpointUnusableError: /x holds checkpoints but none verifies"])
def test_deterministic_errors_are_never_retried(tmp_path, last_line):
    err = _error(f"rank 0 of 2 failed: {last_line}", f"Traceback (most recent call last):\n  ...\n{last_line}\n", 0, 1)
    assert not retryable(err)
    assert retryable(_error("rank 0 of 2 failed: RuntimeError: x", "Traceback\nRuntimeError: ConfigError-like text"))
    calls = []

    def start():
        calls.append(1)
        raise err

    with pytest.raises(SpawnError):
        supervise(start, 5, tmp_path, say=lambda _: None)
    assert len(calls) == 1 and read_events(tmp_path, "restart") == []
    assert [(e["restarts"], e["retryable"]) for e in read_events(tmp_path, "failed")] == [(0, False)]


def test_config_errors_before_any_rank_starts(tmp_path, monkeypatch):
    cfg = load_config("debug")
    with pytest.raises(ConfigError, match=r"--max-restarts \(-1\) must be >= 0"):
        launch(cfg, tmp_path / "run", 2, max_restarts=-1)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match="under torchrun use torchrun's --max-restarts"):
        launch(cfg, tmp_path / "run", None, max_restarts=3)
    assert not (tmp_path / "run").exists()


def test_torchrun_restart_is_logged_by_rank_zero(tmp_path, monkeypatch):
    (tmp_path / "checkpoints" / "step_00000012").mkdir(parents=True)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert note_torchrun_restart(tmp_path, 0) is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    assert note_torchrun_restart(tmp_path, 1) is None
    ev = note_torchrun_restart(tmp_path, 0)
    assert read_events(tmp_path, "restart") == [ev]
    assert (ev["step"], ev["attempt"], ev["max_restarts"], ev["launcher"]) == (12, 2, 3, "torchrun")
