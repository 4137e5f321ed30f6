"""``plan --rehearse``'s ranking and its reduced rehearsal batch, with the rehearsal replaced by a
stand-in that reports chosen peaks (the real one: tests/rehearsal/test_planner_vs_rehearsal.py)."""
from __future__ import annotations

from ndtrain.cli import plan_rehearse
from ndtrain.planner.hardware import Cluster, get_accelerator
from ndtrain.planner.layout import Layout, Workload
from ndtrain.planner.model_spec import load_model_spec
from ndtrain.planner.search import evaluate


def test_rehearsal_batch_reaches_the_steady_state_peak():
    """pp = 1: 2 microbatches; 1F1B pp4: rank 0 holds 4 in flight, so 8 (two rounds of 4 > 4 + 1 - 1);
    never more than the real batch."""
    w = Workload(seq_len=32, global_batch_tokens=32 * 64)
    over = plan_rehearse.rehearsal_overrides(Layout(dp_shard=4, microbatch=2), w)
    assert over["training.global_batch_size"] == str(2 * 2 * 4)
    over = plan_rehearse.rehearsal_overrides(Layout(pp=4, dp_shard=2, microbatch=1), w)
    assert over["training.global_batch_size"] == str(8 * 1 * 2)
    small = Workload(seq_len=32, global_batch_tokens=32 * 4)
    assert plan_rehearse.rehearsal_overrides(Layout(pp=4, dp_shard=1), small)["training.global_batch_size"] == "4"


def test_rehearsed_ranking_drops_what_does_not_fit(monkeypatch):
    """Three candidates: the fastest by the planner does not fit when rehearsed and is dropped with
    its peak as the reason; the others rank 1, 2 by planner time; each stage carries both figures."""
    spec, _ = load_model_spec("debug")
    cluster = Cluster(get_accelerator("H100"), 2, 8)
    w = Workload(seq_len=32, global_batch_tokens=32 * 8, memory_model="trainer")
    plans = [evaluate(spec, cluster, w, Layout(dp_shard=2, zero_stage=z)) for z in (0, 1, 2)]
    plans[0].step.step_time_s, plans[1].step.step_time_s, plans[2].step.step_time_s = 1.0, 3.0, 2.0
    peaks = {"0": 100 * 2**30, "1": 2**30, "2": 2 * 2**30}

    def fake(preset, over, cfg, world, hw, warmup, progress, only, routing):
        z = over.get("parallel.zero_stage", "0")
        return {"roles": [{"role": {"stage": 0, "name": "all ranks"}, "memory_peak": {"total": peaks[z]}}]}
    monkeypatch.setattr("ndtrain.rehearsal.run.rehearse", fake)
    recs = plan_rehearse.rehearse_top("debug", spec, cluster, w, plans, 3)
    assert [r["rank"] for r in recs] == [1, 2, None]
    assert "zero_stage=2" in recs[0]["layout"] and "zero_stage=1" in recs[1]["layout"]
    assert not recs[2]["fits"] and recs[2]["reason"].startswith("rehearsed peak 100.0 GiB on stage 0")
    st = recs[0]["stages"][0]
    assert st["rehearsed_bytes"] == 2 * 2**30 and st["error"] == st["planner_bytes"] / st["rehearsed_bytes"] - 1
