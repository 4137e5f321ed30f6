"""The rehearsal against the real run: the same layout trained for real on gloo ranks and
rehearsed on a fake process group with fake tensors, the same step measured the same way.

Bytes per mesh axis and the collectives (count per op) must be equal exactly; peak tensor memory
per category within 5% (seen: equal); ranks of one role must really be alike in the real run."""
from __future__ import annotations

import pytest

from ndtrain.config import load_config
from ndtrain.rehearsal.roles import rank_roles
from ndtrain.rehearsal.run import rehearse
from tests.dist_utils import run_ranks

MEM = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "buffers", "total")


def _real(rank: int, world: int, preset: str, overrides: dict) -> dict:
    from ndtrain.rehearsal.worker import measure_real_rank

    return measure_real_rank(rank, world, preset, overrides, warmup=1)


def _check(world: int, preset: str, overrides: dict, slack: float = 0.0) -> dict:
    """``slack``: a share of the real rank's peak total each category may differ by beyond its 5%,
    and the real ranks of one role from each other (0: equal)."""
    cfg = load_config(preset, overrides, world_size=world)
    real = run_ranks(_real, world, preset, overrides)
    res = rehearse(preset, overrides, cfg, world, "H100")
    roles = rank_roles(cfg, world)
    assert [r["role"]["rank"] for r in res["roles"]] == [r.rank for r in roles]
    for role, fake in zip(roles, res["roles"]):
        ref = real[role.rank]
        assert fake["axis_bytes"] == ref["axis_bytes"], role.name
        assert fake["collectives"] == ref["collectives"], role.name
        assert fake["ndtrain_state"] == ref["ndtrain_state"], role.name
        for cat in MEM:
            want, got = ref["memory_peak"].get(cat, 0), fake["memory_peak"].get(cat, 0)
            tol = 0.05 * max(want, 1) + slack * ref["memory_peak"]["total"]
            assert abs(got - want) <= tol, (role.name, cat, got, want)
        alike = [r for r in range(world) if r // (world // cfg.parallel.pp) == role.stage]
        for r in alike:  # the role's claim: its ranks are alike in the real run
            assert real[r]["axis_bytes"] == ref["axis_bytes"], (role.name, r)
            gap = abs(real[r]["memory_peak"]["total"] - ref["memory_peak"]["total"])
            assert gap <= slack * ref["memory_peak"]["total"], (role.name, r, gap)
    return res


def test_rehearsal_equals_real_run_pp2_dp2_zero3():
    """pp2 x dp2 ZeRO-3 on the debug preset: two roles (embedding stage, head stage)."""
    res = _check(4, "debug", {"parallel.pp": 2, "parallel.zero_stage": 3})
    assert [r["role"]["name"] for r in res["roles"]] == ["stage 0: blocks 0 + embedding", "stage 1: blocks 1 + head"]
    pp = res["roles"][0]["collectives"]["pp"]
    assert pp["send"] == pp["recv"] == 4  # 2 microbatches, 1F1B: 2 activations out, 2 grads in
    assert res["roles"][0]["memory_peak"]["total"] > 0


# pp2_tp2_sp_bf16, stage 0 (it receives gradients only): the real rank peaks in a backward holding
# 16,384 activation bytes more than the rehearsed one (326,532 against 310,148, 5.0%; totals
# 893,868 / 877,484), the size of two of its (2, 16, 64) fp32 gradient messages. Both take the
# same messages at the same tracked memory (263,112 activation bytes at each take, seen); 8,192 of
# the gap predate counting taken messages, and that part is untraced. Slack: 2% of the total.
@pytest.mark.slow
@pytest.mark.parametrize("world,overrides,slack", [
    (4, {"parallel.tp": 2}, 0.0),
    (8, {"parallel.pp": 2, "parallel.tp": 2, "parallel.zero_stage": 3}, 0.0),
    (4, {"parallel.cp": 2, "parallel.tp": 2}, 0.0),
    (4, {"parallel.tp": 2, "parallel.sequence_parallel": True, "training.dtype": "bfloat16", "parallel.pp": 2}, 0.02),
    (4, {"parallel.pp": 4, "model.n_layers": 4, "model.tie_embeddings": True}, 0.0),
], ids=["dp2_tp2", "pp2_tp2_dp2_zero3", "cp2_tp2", "pp2_tp2_sp_bf16", "pp4_tied"])
def test_rehearsal_equals_real_run(world, overrides, slack):
    _check(world, "debug", overrides, slack)


@pytest.mark.slow
def test_zero_bubble_under_zero1_bf16_sends_the_compute_dtype():
    """pp2 x dp2, zero_bubble, ZeRO-1, bf16: the last stage's input-gradient pass is
    ``autograd.grad`` over its received activation, a leaf, and
    the stages exchange ZeRO's bf16 compute dtype (``worker.pipeline_header``; float32 before:
    twice the last stage's pp bytes). Bytes per axis, collectives and ndtrain's state of both
    stages as in the real run, the last stage's memory per category too. Not equal, not traced:
    the first stage's peak, 1,402,920 rehearsed against 1,599,784 real bytes (the real rank peaks
    in the forward holding 279,040 more activation bytes, twice its parameters; 1F1B the same)."""
    over = {"parallel.pp": 2, "parallel.pp_schedule": "zero_bubble", "parallel.zero_stage": 1,
            "training.dtype": "bfloat16"}
    cfg = load_config("debug", over, world_size=4)
    real = run_ranks(_real, 4, "debug", over)
    res = rehearse("debug", over, cfg, 4, "H100")
    for fake in res["roles"]:
        ref = real[fake["role"]["rank"]]
        for k in ("axis_bytes", "collectives", "ndtrain_state"):
            assert fake[k] == ref[k], (fake["role"]["name"], k)
    assert res["roles"][1]["memory_peak"] == real[2]["memory_peak"]
    assert res["roles"][1]["axis_bytes"]["pp"] == 16528  # with float32 messages: 32,912


def test_roles_of_a_pipeline():
    """One role per stage; the representative is the stage's first rank; blocks follow plan_stage."""
    cfg = load_config("debug", {"parallel.pp": 2, "model.n_layers": 4}, world_size=8)
    roles = rank_roles(cfg, 8)
    assert [(r.name, r.rank, r.ranks_alike, r.layers, r.embedding, r.head) for r in roles] == [
        ("stage 0: blocks 0-1 + embedding", 0, 4, ["0", "1"], True, False),
        ("stage 1: blocks 2-3 + head", 4, 4, ["2", "3"], False, True)]


def test_rehearse_rejects_a_bad_layout_before_any_process(capsys):
    """Exit 2 with the rule's one line; no worker starts (a worker would take seconds and fail)."""
    from ndtrain.cli.commands import main

    assert main(["rehearse", "--config", "debug", "--gpus", "3", "--parallel.tp=2"]) == 2
    assert capsys.readouterr().err.strip() == \
        "ndtrain: invalid config: world_size (3) is not divisible by pp*dp_replicate*cp*tp (2)"
    assert main(["rehearse", "--config", "debug", "--gpus", "2", "--hardware", "Z9000"]) == 2
    assert capsys.readouterr().err.strip().startswith("ndtrain: invalid config: unknown hardware 'Z9000'; known: H100")
    assert main(["rehearse", "--config", "debug", "--gpus", "2", "--moe-routing", "balanced"]) == 2
    assert capsys.readouterr().err.strip() == \
        "ndtrain: invalid config: --moe-routing balanced needs an MoE model (model.moe_experts > 0)"
    assert main(["rehearse", "--config", "moe_debug", "--gpus", "2", "--moe-routing", "even"]) == 2
    assert capsys.readouterr().err.strip() == \
        "ndtrain: invalid config: --moe-routing (even) must be uniform | balanced | skewed:S"


def test_storage_bytes_of_fake_tensors():
    """Fake tensors have no data pointer: each storage still counts once, views with it."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ndtrain.mem_account import storage_bytes

    with FakeTensorMode():
        a, b = torch.empty(10, dtype=torch.float64), torch.empty(3, dtype=torch.float32)
        assert storage_bytes([a, a[2:5], a.view(2, 5), b, None]) == 80 + 12


def test_host_reads_answer_real_values_queued_values_by_dtype_and_stand_ins():
    import torch

    from ndtrain.rehearsal.fake import fake_tensors

    real = torch.arange(3)
    with fake_tensors() as reads:
        assert real.tolist() == [0, 1, 2]  # a real tensor read directly: its own values
        assert real[2].item() == 1  # ... but an op on it makes a fake: a stand-in
        x = torch.empty(4)
        reads.expect([(torch.int64, 7), (torch.float64, 2.5)])
        assert bool(x.sum() > 0) is True  # a bool read between: stand-in, queue untouched
        assert int(torch.empty(3, dtype=torch.int64).sum()) == 7
        assert float(torch.empty((), dtype=torch.float64)) == 2.5
        assert float(x.sum()) == 1.0 and not reads.queue
        assert torch.tensor(3.5).item() == 3.5  # a fake constant: its own value
        with reads.as_value(0.0):
            assert float(x.max()) == 0.0
        assert reads.reads == 6


@pytest.mark.slow
def test_rehearsal_equals_real_run_moe_ep2_dp2_zero1_balanced():
    """ep2 x dp2 ZeRO-1 on moe_debug under forced balanced routing: the dispatch's split sizes come
    from the routing's counts (rehearsal.routing), so the all-to-all bytes equal the real run's."""
    over = {"parallel.ep": 2, "parallel.zero_stage": 1, "training.moe_routing": "balanced"}
    res = _check(4, "moe_debug", over)
    (role,) = res["roles"]
    # local batch 2 = 1 microbatch; per layer: counts, dispatch, combine forward, their two backward
    assert role["collectives"]["ep"]["all_to_all_v"] == 2 * 5
    assert role["axis_bytes"]["ep"] > 0


def test_skewed_routing_counts_and_roles():
    """skewed:S: ep rank 0's experts get S x the mean over whole cycles; two roles per stage, the
    busiest ep rank (ep 0) and the others (ep 1 = global rank + tp)."""
    import torch

    from ndtrain.rehearsal.routing import parse_routing, skew_weights, skewed_assignment

    assert skew_weights(1.5, 2) == (3, 1) and skew_weights(4, 4) == (1, 0)
    counts = torch.bincount(skewed_assignment(1.5, 2)((2, 32), 2, 8).reshape(-1), minlength=8)
    assert counts.tolist() == [24] * 4 + [8] * 4  # rank 0: 96 of 128 assignments = 1.5 x the mean 64
    with pytest.raises(ValueError, match=r"S must be a number in \[1, ep = 2\]"):
        parse_routing("skewed:3", 2)
    cfg = load_config("moe_debug", {"parallel.ep": 2, "parallel.pp": 2, "parallel.tp": 2}, world_size=8)
    roles = rank_roles(cfg, 8, "skewed:1.5")
    assert [(r.name, r.rank, r.ranks_alike) for r in roles] == [
        ("stage 0: blocks 0 + embedding | busiest ep rank", 0, 2), ("stage 0: blocks 0 + embedding | other ep ranks", 2, 2),
        ("stage 1: blocks 1 + head | busiest ep rank", 4, 2), ("stage 1: blocks 1 + head | other ep ranks", 6, 2)]


def test_skewed_rehearsal_feeds_the_busiest_rank_s_times_the_mean(monkeypatch):
    """In the fake world the dispatch hands each rank's experts the rows the routing implies:
    moe_debug, 64 tokens x top-2 per rank, ep2, skewed:1.5 -> 192 rows on ep rank 0, 64 on ep rank 1."""
    from ndtrain.model import moe
    from ndtrain.rehearsal.worker import rehearse_rank

    rows, orig = [], moe.GroupedExperts.forward
    monkeypatch.setattr(moe.GroupedExperts, "forward", lambda self, x, c, *a, **k: rows.append(x.shape[0])
                        or orig(self, x, c, *a, **k))
    over = {"parallel.ep": 2, "parallel.zero_stage": 1, "training.moe_routing": "balanced"}
    cfg = load_config("moe_debug", over, world_size=4)
    for rank, want in ((0, 192), (1, 64)):
        rows.clear()
        rehearse_rank(cfg, 4, rank, warmup=0, routing="skewed:1.5")
        assert rows == [want] * 2, rank  # one microbatch, two MoE layers


@pytest.mark.slow
def test_rehearsal_equals_real_run_deepseek_pp2_ep2_zero1_balanced():
    """pp2 x ep2 (dp2) ZeRO-1 on deepseek_v3_debug (MLA, MoE from block 1, MTP on the last stage),
    forced balanced routing: bytes per axis, collectives (the pipeline's metric all-reduces among
    them) and every memory category of both stages as in the real run. Seen equal in two of three
    runs; in one the real stage 0 held no gradients at its peak moment, the rehearsal 24 KiB
    (likely the real pipeline's receiver threads allocating at other moments). The two real ranks of
    stage 1 (ep ranks 0 and 1) hold 16,512 bytes (0.3%) different activations at their peaks, in
    every run seen (not traced), so they are alike to 1%, not exactly; the rehearsal's rank 2 has
    rank 2's figures. So a category, and a real rank of a role, may move by 1% of the peak."""
    over = {"parallel.pp": 2, "parallel.ep": 2, "parallel.zero_stage": 1, "training.moe_routing": "balanced"}
    res = _check(4, "deepseek_v3_debug", over, slack=0.01)
    first, last = res["roles"]
    assert last["role"]["name"] == "stage 1: blocks 2 + head + mtp"
    # per MoE layer and microbatch 5 all-to-alls (counts, dispatch, combine, their backward); 2
    # microbatches; stage 0 holds one MoE block, stage 1 one and the MTP block
    assert first["collectives"]["ep"]["all_to_all_v"] == 10 and last["collectives"]["ep"]["all_to_all_v"] == 20
    assert first["collectives"]["pp"]["all_reduce"] == last["collectives"]["pp"]["all_reduce"] == 6
