"""The configuration sweep's share of the default suite (the full sweep is
``python scripts/sweep.py``, which writes ``docs/compatibility.md``; the resume sweep is
``python scripts/sweep.py --resume``).

``ndtrain.tools.sweep.SUBSET``: 28 combinations on 2 gloo ranks covering every axis (dp_replicate,
dp_shard, cp ring and Ulysses, tp with and without SP, each pp schedule including DualPipeV, ep,
expert_tp), every model feature (dense, tied head, MoE, MLA, MTP, the LMGA hybrid of linear-family
mixers, DeepSeek's MLA + MoE + MTP), ZeRO 0-3, each activation-checkpointing policy, each dtype and
the fused loss at least once, with one representative of each composition made to work lately (EP
x ZeRO-3, MoE x TP with split experts, MLA + MTP x CP, hybrid x CP / TP, MTP x ZeRO-3); plus
rejected combinations whose rule text is checked (no processes).

Reference: the single-process run of the same model config (``ndtrain.tools.sweep_groups.reference``: world 1,
ZeRO 0, no checkpointing, same fixed batches). float64 combinations must match its loss, gradient
norm and MoE aux / MTP losses on every rank and step to 1e-9 relative (``ndtrain.tools.sweep.RTOL``: a
layout only reorders float64 sums, ~1e-14 after 2 steps; a fault moves them by far more than 1e-6);
float32 to 1e-5 (3e-7 seen at most; ``ndtrain.tools.sweep.TOLERANCE``). bfloat16 / float16 have no exact
reference: they must run with a finite loss.

Resume (``ndtrain.tools.resume_sweep``): ``resume_subset()`` on 2 ranks, each stopped after step 2
(DiLoCo: also inside an interval, step 3) and resumed with the run loop's own save / resume; the
same layout must replay the uninterrupted run bitwise (every step's values and the whole final
state, any dtype), another layout must load the state bitwise and continue within the layout
tolerance. The check itself must fail when a resume forgets a piece of state (sabotaged resumes).
"""
from __future__ import annotations

import math
import re

import pytest

from ndtrain.tools import resume_sweep as RS
from ndtrain.tools import sweep as S
from ndtrain.tools.sweep_groups import compare, run_group

PP = {"pp_virtual_stages": 1}
# every row must still be rejected, with its rule's text: the rules that remain after MoE / MLA /
# MTP x TP / CP / PP, EP x ZeRO and the linear mixers under TP / CP / PP were made to work
REJECTED = [  # (feature, world, parallel, zero / ac / fused, the rule's text must match)
    ("dense", 2, {"dp_shard": 2, "ep": 2}, {}, r"ep \(2\).*MoE"),
    ("moe", 4, {"pp": 2, "pp_schedule": "dualpipev", "dp_shard": 2, **PP}, {}, r"dualpipev needs >= 2 \* pp"),
    ("dense", 4, {"pp": 4, "pp_schedule": "interleaved", "pp_virtual_stages": 2}, {},
     r"n_layers \(4\).*\(8\)"),
    ("dense", 2, {"pp": 2, "pp_schedule": "zero_bubble", **PP}, {"ac": "full"},
     r"zero_bubble.*activation_checkpoint"),
    ("deepseek", 2, {"pp": 2, "pp_schedule": "dualpipev", **PP}, {"ac": "every:2"},
     r"dualpipev.*activation_checkpoint"),
    ("moe", 4, {"tp": 4, "expert_tp": 8}, {}, r"ep\*expert_tp \(8\) does not divide the ranks of a pp stage"),
    ("hybrid", 4, {"tp": 4}, {}, r"gated_deltanet key heads.*tp \(4\)"),
    ("hybrid", 2, {"cp": 2, "cp_impl": "ring", "cp_layout": "load_balanced"}, {},
     r"layer_pattern.*cp \(2\).*cp_layout contiguous"),
    ("mtp", 2, {"dp_shard": 2}, {"fused": True}, r"fused_loss.*mtp_depth \(1\)"),
    ("lora", 2, {"dp_shard": 2}, {"extra": (("training.optimizer", "muon"),)},
     r"lora_rank > 0 needs training.optimizer=adamw \(got muon\)"),
]


@pytest.mark.parametrize("feature,world,par,kw,rule", REJECTED,
                         ids=[S.make_combo(f, w, p, **kw).key for f, w, p, kw, _ in REJECTED])
def test_rejected_before_any_process_with_its_rule(feature, world, par, kw, rule):
    combo = S.make_combo(feature, world, par, **kw)
    got = S.check(combo)
    assert got is not None, f"{combo.key} passed validation"
    assert re.search(rule, got, re.IGNORECASE), got


def test_subset_covers_every_axis_feature_stage_policy_and_dtype():
    combos = S.subset_combos()
    pars = [dict(c.par) for c in combos]
    assert {c.feature for c in combos} == set(S.FEATURES)
    assert {c.zero for c in combos} == set(S.ZERO_STAGES)
    assert {c.ac for c in combos} == set(S.AC_POLICIES)
    assert {c.dtype for c in combos} == set(S.DTYPES)
    assert {p["pp_schedule"] for p in pars if "pp_schedule" in p} == set(S.PP_SCHEDULES)
    assert {p["cp_impl"] for p in pars if "cp_impl" in p} == {"ring", "ulysses"}
    assert {p.get("sequence_parallel", False) for p in pars if "tp" in p} == {False, True}
    for axis in ("dp_replicate", "dp_shard", "ep", "expert_tp"):
        assert any(axis in p for p in pars), axis
    assert any(c.fused for c in combos)
    new = {("moe", "ep", 3), ("moe", "expert_tp", None), ("deepseek", "cp", None), ("hybrid", "cp", None),
           ("hybrid", "tp", None), ("mtp", "dp_shard", 3), ("moe", "moe_dispatch", None)}  # made to work lately
    for feature, axis, zero in new:
        assert any(c.feature == feature and axis in dict(c.par) and zero in (None, c.zero) for c in combos), \
            (feature, axis, zero)


def test_product_has_each_feature_in_its_tiers_and_expert_tp_only_for_moe():
    combos = S.enumerate_combos()
    assert len({c.key for c in combos}) == len(combos)
    for f in S.FULL_PRODUCT:
        assert {c.tier for c in combos if c.feature == f} == set(S.TIERS), f
    assert {c.tier for c in combos if c.feature == "deepseek"} == {"layout"}
    assert all(c.fused == (c.tier == "fused") for c in combos)
    etp = [c for c in combos if dict(c.par).get("expert_tp", 1) > 1]
    assert etp and all(S.FEATURES[c.feature].get("moe_experts") for c in etp)
    folded = [dict(par) for _, par in S.FOLDED]
    assert all((dict(c.par).get("tp") == dict(c.par)["expert_tp"] or dict(c.par) in folded)
               and "pp" not in dict(c.par) for c in etp)  # expert_tp = tp, or a folded expert mesh
    assert {c.key for c in combos if dict(c.par) in folded and c.zero == 0 and c.tier == "layout"}
    w4 = {c.zero for c in combos if c.world == 4 and set(dict(c.par)) == {"cp", "cp_impl"}}
    assert w4 == {0, 3}  # cp4 alone: ZeRO-1/2 only on 1-2 ranks, ep and HSDP layouts
    assert {c.zero for c in combos if c.world == 4 and "ep" in dict(c.par)} == set(S.ZERO_STAGES)


def test_a_failed_rank_with_stuck_peers_is_an_error_after_the_grace(tmp_path, monkeypatch):
    """Rank 0 raised, rank 1 waits forever in a collective (never writes): the watcher reports the
    error after ``FAILED_GRACE_S``, not the hang timeout."""
    import json
    import time

    import ndtrain.tools.sweep_groups as G

    class Alive:
        def is_alive(self):
            return True

    monkeypatch.setattr(G, "FAILED_GRACE_S", 0.2)
    combo = S.make_combo("dense", 2, {"dp_shard": 2})
    (tmp_path / "g0_c0_r0.json").write_text(json.dumps(
        {"ok": False, "error": "RuntimeError: boom", "tb": "tb", "seconds": 0.1, "threads": 5}))
    results, t0 = [], time.monotonic()
    done, state = G._watch([Alive(), Alive()], tmp_path, 0, [combo], 60.0, results, lambda r: None)
    assert (done, state) == (1, "stuck") and time.monotonic() - t0 < 5.0
    r = results[0]
    assert r.status == "error" and "rank 0: RuntimeError: boom" in r.detail and r.extra["stuck_ranks"] == [1]


def test_compare_flags_a_wrong_loss_and_accepts_reordered_sums():
    ref = [{"loss": 4.0, "grad_norm": 1.5}, {"loss": 3.9, "grad_norm": 1.4}]
    f64 = S.make_combo("dense", 2, {"dp_shard": 2})
    near = [[{k: v * (1 + 1e-13) for k, v in row.items()} for row in ref]] * 2
    assert compare(f64, near, ref)[0] == "pass"
    off = [[ref[0], {**ref[1], "grad_norm": 1.4 * (1 + 1e-8)}], ref]  # rank 0, step 2 only
    status, rel, where = compare(f64, off, ref)
    assert status == "mismatch" and rel == pytest.approx(1e-8, rel=1e-3) and "rank 0 step 2" in where
    missing = [[{"loss": 4.0, "grad_norm": 1.5, "aux_loss": 0.1}, ref[1]]]
    assert compare(f64, missing, ref)[0] == "mismatch"
    f32 = S.make_combo("dense", 2, {"dp_shard": 2}, dtype="float32")
    assert compare(f32, [[{**ref[0], "loss": 4.0 * (1 + 1e-6)}, ref[1]]], ref)[0] == "pass"
    assert compare(f32, [[{**ref[0], "loss": 4.0 * (1 + 1e-4)}, ref[1]]], ref)[0] == "mismatch"
    bf16 = S.make_combo("dense", 2, {"dp_shard": 2}, dtype="bfloat16")
    assert compare(bf16, [[{"loss": 4.01, "grad_norm": 1.5}, ref[1]]], ref)[0] == "runs"
    assert compare(bf16, [[{"loss": math.nan, "grad_norm": 1.5}, ref[1]]], ref)[0] == "nonfinite"


def test_subset_trains_2_steps_equal_to_one_process():
    combos = S.subset_combos()
    rules = {c.key: S.check(c) for c in combos}
    assert all(r is None for r in rules.values()), {k: r for k, r in rules.items() if r}
    results = run_group(2, combos, timeout_s=180.0, log=lambda r: None)
    assert [r.combo for r in results] == combos
    for r in results:
        want = "pass" if r.combo.dtype in S.TOLERANCE else "runs"
        assert r.status == want, (r.combo.key, r.status, r.detail, r.extra.get("traceback"))
        if want == "pass":
            assert r.rel <= S.TOLERANCE[r.combo.dtype], (r.combo.key, r.rel)


def test_resume_subset_replays_the_uninterrupted_run_bitwise():
    combos = RS.resume_subset()
    assert {c.feature for c in combos} >= {"dense", "moe", "hybrid", "mtp"}
    assert {c.dtype for c in combos} >= {"float64", "float16"}
    extras = {k for c in combos for k, _ in c.extra}
    assert {"training.local_sgd_steps", "training.stop_at_step", "checkpoint.async_save"} <= extras
    assert all(RS.check_resume(c) is None for c in combos)
    results = run_group(2, combos, timeout_s=240.0, log=lambda r: None, mode="resume")
    assert [r.combo for r in results] == combos
    bad = [(r.combo.key, r.status, r.detail, r.extra.get("traceback", "")[-300:]) for r in results
           if r.status != "pass"]
    assert not bad, "\n".join(map(str, bad))
    assert all(r.extra["same"] == "pass" for r in results)
    assert sum(r.extra["other"] == "pass" for r in results) >= len(combos) - 2  # DiLoCo on 2 ranks: none


def _drop_sampler(real):
    def resume(r, path):
        consumed = r.sampler.consumed
        real(r, path)
        r.sampler.consumed = consumed  # the data position is not restored
    return resume


def _drop_expert_bias(real):
    def resume(r, path):
        real(r, path)
        for name, buf in r.trainer.model.named_buffers():
            if name.endswith("expert_bias"):
                buf.zero_()
    return resume


def _drop_loss_scale(real):
    def resume(r, path):
        real(r, path)
        r.trainer.scaler.scale *= 2
    return resume


@pytest.mark.parametrize("feature,dtype,sabotage,want", [
    ("dense", "float64", _drop_sampler, r"step 3 (loss|n_tokens)"),
    ("moe", "float64", _drop_expert_bias, r"step 3 \w+: .*final state: .*expert_bias|step 3"),
    ("dense", "float16", _drop_loss_scale, r"step 3 (loss_scale|grad_norm|loss)"),
], ids=["sampler", "expert_bias", "loss_scale"])
def test_resume_check_fails_when_the_resume_forgets_state(tmp_path, monkeypatch, feature, dtype, sabotage, want):
    from ndtrain.train import loop

    combo = S.make_combo(feature, 1, {}, dtype=dtype, extra=(("training.loss_scale_growth_interval", 1),)
                         if dtype == "float16" else ())
    if sabotage is _drop_sampler:  # the same combination passes unsabotaged (the others: the subset)
        assert RS.run_resume(combo, 1, tmp_path / "ok") == {
            "same": {"status": "pass", "detail": ""}, "other": {"status": "pass", "detail": ""},
            "other_layout": "dense | single | zero3 | ac=none | float64"}
    monkeypatch.setattr(loop, "_resume", sabotage(loop._resume))
    v = RS.run_resume(combo, 1, tmp_path / "bad")
    assert v["same"]["status"] == "mismatch" and re.search(want, v["same"]["detail"]), v
    assert v["other"]["status"] == "mismatch", v  # the other layout resumes through it too


def test_compare_rows_and_states_are_bitwise_or_within_tolerance():
    import torch

    rows = [{"loss": 4.0, "grad_norm": 1.5}]
    assert RS.compare_rows([{"loss": 4.0, "grad_norm": 1.5}], rows, 0.0, 3) is None
    one_ulp = [{"loss": math.nextafter(4.0, 5.0), "grad_norm": 1.5}]
    assert RS.compare_rows(one_ulp, rows, 0.0, 3).startswith("step 3 loss: 4.000000000000001 vs 4.0")
    assert RS.compare_rows(one_ulp, rows, 1e-9, 3) is None
    assert "not finite" in RS.compare_rows([{"loss": math.inf, "grad_norm": 1.0}], rows, None, 3)
    w = {"a": torch.ones(3, dtype=torch.float64), "b": 2}
    assert RS.compare_states({"a": torch.ones(3, dtype=torch.float64), "b": 2}, w, 0.0) is None
    g = {"a": torch.tensor([1.0, 1.0, 1.0 + 2**-52], dtype=torch.float64), "b": 2}
    assert RS.compare_states(g, w, 0.0) == "1 of 2 state entries differ; worst a: max |diff| 2.22e-16"
    assert RS.compare_states(g, w, 1e-9) is None
    assert RS.compare_states({"b": 2}, w, 0.0) == "1 of 2 state entries differ; worst a missing"
    assert RS.compare_states(g, w, 0.0, skip={"a"}) is None
