"""The planner's trainer accounting against the rehearsal of a real-width preset, and
``ndtrain plan --rehearse`` end to end (both slow: each rehearsed role is a process that builds
the full-size trainer on fake tensors)."""
from __future__ import annotations

import json

import pytest

from ndtrain.calibration.calibrate import trainer_layout
from ndtrain.config import load_config
from ndtrain.planner.layout import Workload
from ndtrain.planner.memory import estimate_memory
from ndtrain.planner.model_spec import from_model_config
from ndtrain.rehearsal.run import rehearse


@pytest.mark.slow
def test_planner_within_10_percent_of_the_rehearsal_llama3_8b_tp8():
    """Llama 3 8B at full width, tp8, one 8,192-token sequence, bf16 autocast: the planner's
    per-stage total (memory_model trainer) within 10% of the rehearsed peak, and its activations
    (blocks + loss) within 10% of the rehearsed activations + temporaries."""
    over = {"parallel.tp": "8", "training.global_batch_size": "1", "training.micro_batch_size": "1"}
    cfg = load_config("llama3_8b", over, world_size=8)
    res = rehearse("llama3_8b", over, cfg, 8, "H100")
    w = Workload(seq_len=cfg.data.seq_len, global_batch_tokens=cfg.data.seq_len, precision="fp32", act_bytes=2,
                 memory_model="trainer")
    est = estimate_memory(from_model_config(cfg.model), w, trainer_layout(cfg, 8), 80e9)
    (role,) = res["roles"]
    peak = role["memory_peak"]
    assert est.per_stage[0] == pytest.approx(peak["total"], rel=0.10)
    act = est.breakdown["activations"] + est.breakdown["logits"]
    assert act == pytest.approx(peak["activations"] + peak.get("temporaries", 0), rel=0.10)
    assert est.breakdown["params"] == pytest.approx(peak["parameters"], rel=0.02)  # fp32 weights (zero 0)


@pytest.mark.slow
def test_plan_rehearse_ranks_and_compares(capsys, tmp_path):
    """``plan --rehearse 1`` on a tiny preset: one record with the rehearsed stage beside the
    planner's, a rank, and the cache reused by a second call (same record, no new rehearsal)."""
    from ndtrain.cli.plan import main

    args = ["--model", "debug", "--hardware", "H100", "--gpus", "2", "--json", "--rehearse", "1",
            "--rehearse-cache", str(tmp_path)]
    assert main(args) == 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith('{"rehearsed"')][-1]
    (rec,) = json.loads(line)["rehearsed"]
    assert rec["fits"] and rec["rank"] == 1 and rec["memory_model"] == "trainer"
    st = rec["stages"][0]
    assert st["rehearsed_bytes"] > 0 and st["planner_bytes"] > 0
    assert st["error"] == pytest.approx(st["planner_bytes"] / st["rehearsed_bytes"] - 1)
    assert len(list(tmp_path.glob("*.json"))) == 1
    assert main(args) == 0
    again = json.loads([ln for ln in capsys.readouterr().out.splitlines() if ln.startswith('{"rehearsed"')][-1])
    assert again["rehearsed"][0]["stages"] == rec["stages"]


@pytest.mark.parametrize("expert_tp", [1, 2])
def test_planner_state_equals_the_rehearsal_for_whole_and_tp_split_experts(expert_tp):
    """moe_debug on 4 ranks as tp2 (SP) x dp_shard 2 with ep 2, ZeRO-1: with the trainer's default
    ``expert_tp`` 1 every tp rank holds whole experts (``trainer_layout`` maps it to the planner's
    expert_tp 1), with expert_tp = tp they are split over the attention tp (the planner's tied
    mesh). The planner's parameters and optimizer state equal the rehearsal's to 1%."""
    over = {"parallel.tp": 2, "parallel.sequence_parallel": True, "parallel.ep": 2, "parallel.zero_stage": 1,
            "parallel.expert_tp": expert_tp, "training.global_batch_size": 2, "training.micro_batch_size": 1,
            "training.moe_routing": "balanced"}
    cfg = load_config("moe_debug", over, world_size=4)
    lay = trainer_layout(cfg, 4)
    assert (lay.expert_tp, lay.etp, lay.expert_shards) == ((1, 1, 1) if expert_tp == 1 else (-1, 2, 1))
    res = rehearse("moe_debug", over, cfg, 4, "H100")
    precision = {"bfloat16": "fp32", "float32": "fp32"}[cfg.training.dtype]
    w = Workload(seq_len=cfg.data.seq_len, global_batch_tokens=2 * cfg.data.seq_len, precision=precision,
                 act_bytes=2 if cfg.training.dtype == "bfloat16" else 4, memory_model="trainer")
    est = estimate_memory(from_model_config(cfg.model), w, lay, 80e9)
    peak = res["roles"][0]["memory_peak"]
    # measured 2026-12-03: the planner 0.28% / 0.46% under the rehearsed parameters and 0.16% / 0.28%
    # under the optimizer state (expert_tp 1 / 2), not traced; experts are 81% of moe_debug's
    # parameters, so splitting them the wrong way (the error this guards against) is off by ~40%
    assert est.breakdown["params"] == pytest.approx(peak["parameters"], rel=0.01)
    assert est.breakdown["optimizer"] == pytest.approx(peak["optimizer_state"], rel=0.01)


@pytest.mark.slow
def test_interleaved_with_as_many_microbatches_as_stages_peaks_at_the_last_backward():
    """Llama 3 405B on 16,384 GPUs (TP8 + SP, PP16 x 8 virtual stages, DP128, ZeRO-1, full
    checkpointing, 2,048 sequences: 16 microbatches per pipeline): stage 1 runs every forward before
    its first backward, so it peaks at the step's last backward with every gradient and almost no
    activations, which the planner now takes (it had the activation peak without gradients, -19%)."""
    over = {"parallel.tp": "8", "parallel.sequence_parallel": "true", "parallel.pp": "16",
            "parallel.zero_stage": "1", "parallel.pp_schedule": "interleaved", "parallel.pp_virtual_stages": "8",
            "training.activation_checkpoint": "full", "training.global_batch_size": "2048",
            "training.micro_batch_size": "1", "data.seq_len": "8192"}
    cfg = load_config("llama3_405b", over, world_size=16384)
    (role,) = rehearse("llama3_405b", over, cfg, 16384, "H100", only=[1])["roles"]
    peak = role["memory_peak"]
    assert peak["gradients"] == pytest.approx(peak["parameters"], rel=0.01)  # every gradient (bf16, ZeRO-1)
    assert peak["activations"] < 0.1 * peak["total"]
    from ndtrain.rehearsal.run import planner_memory

    pm = planner_memory(cfg, 16384, 80e9)
    # measured 2026-12-03: 14.2 GiB rehearsed, 12.9 planned (-9.2%; the block backward's 1.1 GiB of
    # gradient temporaries are not in the planner)
    assert pm["per_stage"][1] == pytest.approx(peak["total"], rel=0.10)
