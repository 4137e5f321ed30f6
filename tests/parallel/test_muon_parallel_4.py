"""Sharded Muon on 4 ranks (float64, 10 steps, 1e-8 relative to the single-process Muon run):
ZeRO-3 over 4 shards (owners spread over 4 ranks), HSDP with ZeRO-3 and ZeRO-1, tp2 x ZeRO-3 and
tp2 x ZeRO-1 + SP (the owner gathers over tp), cp2 x ZeRO-3, pp2 x ZeRO-2, ep2 x ZeRO-1 (experts
sharded over edp_shard 2); a checkpoint of dp4 ZeRO-3 resumed under tp2 x dp2 ZeRO-1 and in one
plain process, and one of ep2 x ZeRO-3 under ep4 x ZeRO-1 and in one process. On 8 ranks (slow):
pp2 x dp2 x tp2 with ZeRO-3. Harness: ``muon_parity``."""
from __future__ import annotations

import pytest

from tests.dist_utils import run_ranks
from tests.parallel import muon_parity as mp

LAYOUTS_4 = {
    "zero3_dp4": ("dense", {"dp_shard": 4, "zero_stage": 3}),
    "hsdp_zero3": ("dense", {"dp_replicate": 2, "dp_shard": 2, "zero_stage": 3}),
    "hsdp_zero1": ("dense", {"dp_replicate": 2, "dp_shard": 2, "zero_stage": 1}),
    "tp2_zero3": ("dense", {"dp_shard": 2, "tp": 2, "zero_stage": 3}),
    "tp2_sp_zero1": ("dense", {"dp_shard": 2, "tp": 2, "zero_stage": 1, "sequence_parallel": True}),
    "cp2_zero3": ("dense", {"dp_shard": 2, "cp": 2, "zero_stage": 3}),
    "pp2_zero2": ("dense", {"dp_shard": 2, "pp": 2, "zero_stage": 2, "micro": 1}),
    "ep2_zero1": ("moe", {"dp_shard": 4, "ep": 2, "zero_stage": 1, "micro": 1}),
}
SRC = {"dp_shard": 4, "zero_stage": 3}
DST = {"dp_shard": 2, "tp": 2, "zero_stage": 1}
MOE_SRC = {"dp_shard": 4, "ep": 2, "zero_stage": 3, "micro": 1}  # experts over ep, then edp_shard
MOE_DST = {"dp_shard": 4, "ep": 4, "zero_stage": 1, "micro": 1}


def _all(rank: int, world: int, ckpt_dir: str) -> dict:
    return {"parity": mp.run(rank, world, LAYOUTS_4),
            "resume": mp.resume(rank, world, ckpt_dir + "/dense", SRC, DST),
            "resume_moe": mp.resume(rank, world, ckpt_dir + "/moe", MOE_SRC, MOE_DST, kind="moe")}


@pytest.fixture(scope="module")
def res4(tmp_path_factory):
    return run_ranks(_all, 4, str(tmp_path_factory.mktemp("muon_ckpt")), timeout_s=1500)


@pytest.mark.slow
def test_4_rank_layouts_equal_the_single_process_muon_run(res4):
    mp.assert_parity([r["parity"] for r in res4])


@pytest.mark.slow
def test_owner_routing_bytes_on_4_shards(res4):
    """Each rank sends the blocks of matrices it does not own once and its own matrices' blocks to
    the 3 others: 8 (sum_{j not mine} s_j + 3 sum_{j mine} s_j) bytes per step on dp_shard_cp;
    every rank owns some; one plan everywhere; the tp2 x ZeRO-3 owner also gathers over tp."""
    plans = []
    for r in res4:
        v = r["parity"]["zero3_dp4"]
        _, owner, sizes = v["owners"]["dp_shard_cp"]
        me = v["mesh"]["dp_shard_cp"][1]
        mine = sum(s for s, o in zip(sizes, owner) if o == me)
        want = 8 * (sum(sizes) - mine + 3 * mine)
        assert all(b == {"dp_shard_cp": want} for b in v["muon_bytes"]), (v["muon_bytes"][0], want)
        assert set(owner) == {0, 1, 2, 3}
        plans.append(v["owners"])
        t = r["parity"]["tp2_zero3"]
        assert all(set(b) == {"dp_shard_cp", "tp"} for b in t["muon_bytes"]), t["muon_bytes"][0]
    assert all(p == plans[0] for p in plans)


@pytest.mark.slow
def test_a_zero3_checkpoint_resumes_under_tp2_zero1_and_in_one_process(res4):
    for r in res4:
        v = r["resume"]
        assert v["loss"] < 1e-8 and v["state"] < 1e-8, v
    one = mp.resume_one_process(res4[0]["resume"]["path"])
    assert one["loss"] < 1e-8 and one["state"] < 1e-8, one


@pytest.mark.slow
def test_an_ep2_zero3_checkpoint_resumes_under_ep4_zero1_and_in_one_process(res4):
    """Expert momenta saved as ep x edp_shard DTensors load into another ep degree and one process."""
    for r in res4:
        v = r["resume_moe"]
        assert v["loss"] < 1e-8 and v["state"] < 1e-8, v
    one = mp.resume_one_process(res4[0]["resume_moe"]["path"], kind="moe", micro=1)
    assert one["loss"] < 1e-8 and one["state"] < 1e-8, one


LAYOUT_8 = {"pp2_dp2_tp2_zero3": ("dense", {"pp": 2, "dp_shard": 2, "tp": 2, "zero_stage": 3, "micro": 1})}


@pytest.mark.slow
def test_4d_pp2_dp2_tp2_zero3_on_8_ranks():
    res = run_ranks(mp.run, 8, LAYOUT_8, timeout_s=1500)
    mp.assert_parity(res)
    assert all(set(b) == {"dp_shard_cp", "tp"} for r in res for b in r["pp2_dp2_tp2_zero3"]["muon_bytes"])
