"""The rehearsal's fast paths (``rehearsal.replay.fast_paths``) against their slow twins: a whole
rehearsed rank with the gradient pack replayed and ``prim.device`` counted by its known row gives
the same figures as one with every operator dispatched (all it reports but wall times); and the
pieces: real tensors still packed, an allocating loop never replayed, a replayed call adding the
rows it would have counted, the device row equal to ``_record``'s."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ndtrain.config import load_config
from ndtrain.parallel.zero.flat_shard import FlatShardLayout
from ndtrain.rehearsal.ops import OpRecorder
from ndtrain.rehearsal.replay import PackReplay, replayable
from ndtrain.rehearsal.worker import rehearse_rank

FIGURES = ("memory_peak", "ndtrain_state", "axis_bytes", "collectives", "saved_weight_copy_bytes",
           "host_reads", "microbatches")
BF16 = {"training.dtype": "bfloat16"}  # bf16 gradients reduced in fp32: the pack's per-piece loop


def _rows(res: dict) -> dict:
    return {(r["op"], r["phase"], r["kind"], tuple(r["dims"]), r["dtype"], r["causal"]): (r["count"], r["flops"], r["bytes"])
            for r in res["ops"]}


def _same_rows(fast: dict, slow: dict) -> None:
    """Equal rows, but ``prim.device``'s count: it moves by a few calls between two runs of the
    same code (seen: 1,212 and 1,214 in one forward, before the fast paths existed too) and costs
    nothing (a view); within 1% of it."""
    a, b = _rows(fast), _rows(slow)
    assert a.keys() == b.keys()
    for k in a:
        if k[0] == "device":
            assert abs(a[k][0] - b[k][0]) <= 0.01 * b[k][0], k
        else:
            assert a[k] == b[k], k


@pytest.mark.parametrize("preset,world,over,routing", [
    ("debug", 4, {**BF16, "parallel.zero_stage": 2, "training.micro_batch_size": 1}, None),
    ("debug", 8, {**BF16, "parallel.pp": 2, "parallel.zero_stage": 3}, None),
    ("moe_debug", 4, {**BF16, "parallel.ep": 2, "parallel.zero_stage": 1, "training.moe_routing": "balanced"},
     "balanced"),
], ids=["zero2_dp4_8mb", "pp2_zero3", "moe_ep2_zero1"])
def test_replayed_rehearsal_equals_the_dispatched_one(preset, world, over, routing):
    """ZeRO-2 (a pack per microbatch: replays), ZeRO-3 under a pipeline, MoE ZeRO-1 with the
    routing twins: equal figures and operator rows; the fast run replayed and skipped calls."""
    cfg = load_config(preset, over, world_size=world)
    fast = rehearse_rank(cfg, world, 0, 1, routing, replay=True)
    slow = rehearse_rank(cfg, world, 0, 1, routing, replay=False)
    for k in FIGURES:
        assert fast[k] == slow[k], k
    _same_rows(fast, slow)
    assert "pack_replay" not in slow
    rp = fast["pack_replay"]
    assert rp["misses"] >= 1 and rp["skipped"] == rp["hits"] + rp["misses"] and rp["refused"] == 0
    if over.get("parallel.zero_stage") == 2:
        assert rp["hits"] > 0  # 8 microbatches, each bucket packed per microbatch


def _pieces():
    layout = FlatShardLayout([torch.Size([5, 3]), torch.Size([4])], n=2, rank=0)  # rows 3 and 2 per rank
    return layout, [torch.arange(15.0).view(5, 3), torch.arange(4.0)]


def test_real_tensors_are_packed_by_the_loop():
    """Outside the fake world the loop runs: rank k's rows, zero padded (the 5-row tensor's 6th row)."""
    layout, ts = _pieces()
    out = PackReplay(FlatShardLayout.pack_reference)(layout, ts, torch.full((layout.padded_numel,), -1.0))
    grid = out.view(2, layout.shard_numel)
    assert grid[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1]
    assert grid[1].tolist() == [9, 10, 11, 12, 13, 14, 0, 0, 0, 2, 3]


def test_replay_adds_the_rows_of_a_dispatched_call_and_refuses_an_allocating_loop():
    """Under a counter, the second call with one signature dispatches nothing and leaves the table
    as two dispatched calls would; a loop that allocates runs every time (``refused``); without a
    counter the loop is skipped."""
    calls = []

    def loop(layout, tensors, out):
        calls.append(1)
        return FlatShardLayout.pack_reference(layout, tensors, out)

    def allocating(layout, tensors, out):
        calls.append(1)
        torch.empty(3)
        return out

    layout, _ = _pieces()
    with FakeTensorMode():
        ts = [torch.empty(5, 3, dtype=torch.bfloat16), torch.empty(4, dtype=torch.bfloat16)]
        out = torch.empty(layout.padded_numel)
        ref = OpRecorder()
        with ref:
            for _ in range(2):
                loop(layout, ts, out)
        rep, rec = PackReplay(loop), OpRecorder()
        with rec:
            rep(layout, ts, out)
            rep(layout, ts, out)
        assert rec.table == ref.table and (rep.hits, rep.misses) == (1, 1) and len(calls) == 3
        assert rec.table[("copy_", "other", "memory", (), "float32", False)][0] == 2 * 2 * 2  # (rank, tensor) x 2
        bad = PackReplay(allocating)
        with OpRecorder():
            bad(layout, ts, out)
            bad(layout, ts, out)
        assert (bad.misses, bad.hits, bad.refused) == (2, 0, 1) and len(calls) == 5
        rep(layout, ts, out)  # no counter active: skipped
        assert rep.skipped == 1 and len(calls) == 5
    assert not replayable({("empty", "bwd", "view", (), "float32", False): (1, 0.0, 0)})
    assert replayable({("copy_", "bwd", "memory", (), "float32", False): (1, 0.0, 8),
                       ("slice", "bwd", "view", (), "float32", False): (2, 0.0, 0)})


def test_device_row_is_the_one_record_counts():
    """``prim.device``'s fast row (``OpRecorder.fast_device``) equals ``_record``'s for it, per
    phase (forward under grad mode, ``other`` without) and dtype."""
    from ndtrain.rehearsal.ops import DEVICE

    fast, slow = OpRecorder(), OpRecorder()
    with FakeTensorMode():
        ts = [torch.empty(2, dtype=torch.bfloat16), torch.empty(3, dtype=torch.float64)]
        for grad in (True, False):
            with torch.set_grad_enabled(grad):
                with fast:
                    for t in ts:
                        DEVICE(t)
                for t in ts:
                    slow._record(DEVICE, (t,), {}, t.device)
    assert fast.table == slow.table and len(fast.table) == 4
    assert fast.table[("device", "other", "view", (), "bfloat16", False)] == [1, 0.0, 0]
