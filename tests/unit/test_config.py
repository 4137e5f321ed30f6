"""Config loading, overrides and validation: every bad layout fails before any process starts."""
from __future__ import annotations

import subprocess
import sys

import pytest

from ndtrain.config import ConfigError, load_config, parse_cli_overrides
from ndtrain.mesh import ParallelDims


def test_presets_load_and_override():
    cfg = load_config("debug", {"training.steps": "7", "model.tie_embeddings": "true",
                                "training.lr": "1e-3"})
    assert cfg.training.steps == 7 and cfg.model.tie_embeddings is True and cfg.training.lr == 1e-3
    for name in ("default", "llama3_8b", "llama3_70b", "llama3_405b"):
        load_config(name)
    big = load_config("llama3_405b")
    assert (big.model.dim, big.model.n_layers, big.model.ffn_dim) == (16384, 126, 53248)


def test_cli_override_parsing():
    assert parse_cli_overrides(["--training.steps=5", "--data.seq_len", "64"]) == {
        "training.steps": "5", "data.seq_len": "64"}
    with pytest.raises(ConfigError, match="section.key"):
        parse_cli_overrides(["--steps=5"])


@pytest.mark.parametrize("overrides,world,rule", [
    ({"model.n_heads": "6", "model.n_kv_heads": "4", "model.dim": "48"}, 1,
     r"n_heads \(6\) is not divisible by n_kv_heads \(4\)"),
    ({"model.dim": "50"}, 1, r"dim \(50\) is not divisible by n_heads \(4\)"),
    ({"training.global_batch_size": "6"}, 4, r"global_batch_size \(6\) is not divisible by .* \(4\)"),
    ({"training.micro_batch_size": "3"}, 2, r"local batch \(4 = .*\) is not divisible by micro_batch_size \(3\)"),
    ({"parallel.dp_shard": "3"}, 4, r"\(3\) != world_size \(4\)"),
    ({"parallel.dp_replicate": "3"}, 4, r"world_size \(4\) is not divisible by pp\*dp_replicate\*cp\*tp \(3\)"),
    ({"training.dtype": "float8"}, 1, r"training.dtype \(float8\) must be one of"),
    ({"parallel.zero_stage": "4"}, 1, r"parallel.zero_stage \(4\) must be 0, 1, 2 or 3"),
    ({"data.seq_len": "4096"}, 1, r"seq_len \(4096\) exceeds model.max_seq_len"),
    ({"parallel.pp_schedule": "dualpipe"}, 1, r"pp_schedule \(dualpipe\) must be"),
    ({"training.activation_checkpoint": "every:0"}, 1, r"activation_checkpoint \(every:0\)"),
    ({"model.vocab_size": "0"}, 1, r"model.vocab_size \(0\) must be positive"),
    ({"model.n_heads": "6", "model.dim": "48", "model.n_kv_heads": "0", "parallel.tp": "4"}, 4,
     r"n_heads \(6\) is not divisible by tp \(4\)"),
    ({"checkpoint.load_from": "a", "checkpoint.init_weights_from": "b"}, 1, r"exclude each other"),
])
def test_invalid_configs_name_the_rule(overrides, world, rule):
    with pytest.raises(ConfigError, match=rule):
        load_config("debug", overrides, world_size=world)


def test_validation_and_planner_share_the_axis_rules():
    """One rule text for a layout, whether a config or the planner checks it."""
    from ndtrain.planner.layout import Layout, Workload, check_layout
    from ndtrain.planner.model_spec import load_model_spec

    spec, _ = load_model_spec("llama3_8b")  # 32 heads
    errs = check_layout(spec, 6, Workload(seq_len=8192, global_batch_tokens=6 * 8192), Layout(tp=3, dp_shard=2))
    with pytest.raises(ConfigError) as cfg_err:
        load_config("llama3_8b", {"parallel.tp": "3"}, world_size=6)
    assert "n_heads (32) is not divisible by tp (3)" in errs
    assert str(cfg_err.value) == "n_heads (32) is not divisible by tp (3)"


def test_unknown_keys_and_types():
    with pytest.raises(ConfigError, match="unknown config key 'training.stepz'"):
        load_config("debug", {"training.stepz": "1"})
    with pytest.raises(ConfigError, match="training.steps: expected int"):
        load_config("debug", {"training.steps": "many"})
    with pytest.raises(ConfigError, match="neither a file nor a preset"):
        load_config("no_such_preset")


def test_parallel_dims():
    from ndtrain.config import ParallelConfig

    d = ParallelDims.from_config(ParallelConfig(dp_replicate=2, dp_shard=-1), 8)
    assert (d.dp_replicate, d.dp_shard, d.dp, d.dp_cp) == (2, 4, 8, 8)
    assert str(d) == "dp_replicate2 x dp_shard4 (world 8)"
    mesh = ParallelDims().build_mesh()  # all ones: no process group needed
    assert mesh.group("dp").size == 1 and mesh.group("dp").pg is None


def test_cli_rejects_bad_layout_before_starting_processes(tmp_path):
    """The CLI exits 2 with the rule, without creating the run directory (no process started)."""
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "ndtrain.cli.commands", "train", "--config", "debug",
                           "--nproc", "4", f"--run-dir={run_dir}", "--training.global_batch_size=6"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "global_batch_size (6) is not divisible" in proc.stderr
    assert not run_dir.exists()
    assert "Traceback" not in proc.stderr


def test_pp_overlap_true_with_device_auto_is_checked_against_the_device_the_ranks_will_use(monkeypatch):
    """``training.device=auto`` on a CUDA machine resolves to CUDA in the ranks, where DualPipeV's
    overlapped pairs are not supported: the rule must fail before any process starts."""
    import torch

    over = {"parallel.pp": 2, "parallel.pp_schedule": "dualpipev", "parallel.pp_overlap": "true",
            "model.n_layers": 4, "training.global_batch_size": 8, "training.micro_batch_size": 1}
    load_config("debug", over, world_size=2)  # CPU here: accepted
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError, match="pp_overlap=true needs training.device=cpu"):
        load_config("debug", over, world_size=2)


def test_activation_checkpoint_policies_are_listed_once():
    """Validation, the parser, the sweep and the benchmark read ``ac_policy.POLICIES``."""
    from ndtrain.parallel.ac_policy import POLICIES, example_policies
    from ndtrain.tools.sweep import AC_POLICIES

    assert POLICIES == ("none", "full", "every:C", "sqrt", "selective", "op", "core_attn", "deepseek")
    assert AC_POLICIES == example_policies() == ("none", "full", "every:2", "sqrt", "selective", "op", "core_attn",
                                                 "deepseek")
    for ac in example_policies(3):
        load_config("debug", {"training.activation_checkpoint": ac})
    with pytest.raises(ConfigError) as info:
        load_config("debug", {"training.activation_checkpoint": "every:0"})
    assert str(info.value) == ("training.activation_checkpoint (every:0) must be "
                               "none|full|every:C|sqrt|selective|op|core_attn|deepseek")


def test_validation_runs_once_per_launch(tmp_path, monkeypatch, capsys):
    """``ndtrain train`` validates in ``load_config`` (with the world size) and the launcher does not
    validate again; an edited config, or another world size, is validated anew."""
    from ndtrain.cli import launch as launch_mod
    from ndtrain.cli.commands import main
    from ndtrain.config import load as load_mod

    calls = []
    real = load_mod._validate
    monkeypatch.setattr(load_mod, "_validate", lambda cfg, world=None: (calls.append(world), real(cfg, world)))

    def stop(cfg, run_dir, world):
        raise ConfigError("stopped before the pre-start checks")

    monkeypatch.setattr(launch_mod, "preflight", stop)
    argv = ["train", "--config", "debug", "--nproc", "2", "--run-dir", str(tmp_path / "run")]
    assert main(argv) == 2
    assert "invalid config: stopped before the pre-start checks" in capsys.readouterr().err
    assert calls == [2]
    cfg = load_config("debug", world_size=2)
    load_mod.validate(cfg, 2)
    assert calls == [2, 2]
    load_mod.validate(cfg, 4)  # another world size: validated again
    cfg.model.n_heads = 3  # an edit after validation is seen
    with pytest.raises(ConfigError, match=r"dim \(64\) is not divisible by n_heads \(3\)"):
        load_mod.validate(cfg, 4)
    assert calls == [2, 2, 4, 4]
