"""The rehearsal's time model: the operators it counts in a real step carry the model's analytic
FLOPs, and its step time is the per-operator roofline summed, plus comm and the pipeline bubble."""
from __future__ import annotations

import math

from ndtrain.config import load_config
from ndtrain.planner.compute import GENERATIONS
from ndtrain.planner.hardware import BANDWIDTH_EFFICIENCY, get_accelerator
from ndtrain.rehearsal.run import rehearse
from ndtrain.rehearsal.timing import job_time, op_seconds
from tests.flops_reference import config_flops_per_token

H100 = get_accelerator("H100")
HOP = GENERATIONS["hopper"]


def test_counted_flops_are_the_analytic_flops_and_time_the_roofline_sum():
    """debug on one rank (bf16 autocast over fp32 weights, 4 microbatches): the GEMM + attention FLOPs the step ran equal the
    PaLM count of ``tests/flops_reference`` less the norms' 6 x weights (elementwise: costed by
    bytes, not FLOPs); the backward runs twice the forward; the head's forward GEMM costs its
    hand roofline; the step is the sum of every operator's seconds (one rank: no comm, no bubble);
    each microbatch's forward saves a bf16 copy of every weight matrix (autocast's casts)."""
    over = {"training.dtype": "bfloat16"}
    cfg = load_config("debug", over, world_size=1)
    m = cfg.model
    res = rehearse("debug", over, cfg, 1, "H100")
    role = res["roles"][0]
    tokens = cfg.training.global_batch_size * cfg.data.seq_len
    counted = {"fwd": 0.0, "bwd": 0.0}
    for r in role["ops"]:
        if r["kind"] in ("gemm", "attention"):
            counted[r["phase"]] += r["flops"]
    norms = (2 * m.n_layers + 1) * m.dim
    want = (config_flops_per_token(m, cfg.data.seq_len) - 6 * norms) * tokens
    assert counted["fwd"] + counted["bwd"] == want
    assert counted["bwd"] == 2 * counted["fwd"]

    b, t, d, v = cfg.training.micro_batch_size, cfg.data.seq_len, m.dim, m.vocab_size
    head = [r for r in role["ops"] if r["op"] == "mm" and r["phase"] == "fwd" and r["dims"] == [1, b * t, v, d]]
    assert len(head) == 1 and head[0]["count"] == role["microbatches"] == 4
    flops = 2.0 * b * t * v * d
    tiles = math.ceil(b * t / 128) * math.ceil(v / 128)  # the 128 x 128 tile (0.9 rate) wins here
    occupancy = b * t * v / (tiles * 128 * 128)  # rows 64 of the tile's 128
    rate = (H100.peak("bfloat16") * HOP.gemm_efficiency * 0.9 * occupancy * tiles
            / (math.ceil(tiles / HOP.units) * HOP.units))
    io = 2 * (b * t * d + d * v + b * t * v) / (H100.hbm_bytes_per_s * HOP.hbm_efficiency)
    assert math.isclose(op_seconds(head[0], H100), 4 * max(flops / rate, io), rel_tol=1e-12)

    total = sum(op_seconds(r, H100) for r in role["ops"])
    assert total > 0 and math.isclose(res["time"]["step_s"], total, rel_tol=1e-12)
    assert res["time"]["bubble_s"] == 0.0
    peak = H100.peak("bfloat16")
    assert math.isclose(res["time"]["mfu"], res["time"]["model_flops"] / (total * peak), rel_tol=1e-12)
    kv = m.n_kv_heads * (m.dim // m.n_heads)
    weights = m.n_layers * (2 * m.dim * m.dim + 2 * m.dim * kv + 3 * m.dim * m.ffn_hidden) + v * d  # + head
    assert role["saved_weight_copy_bytes"] == 2 * weights * role["microbatches"]


def _role(fwd_bytes: float, bwd_bytes: float, axis_bytes: dict, collectives: dict) -> dict:
    ops = [{"op": "add", "phase": "fwd", "kind": "memory", "dims": [], "dtype": "float32", "causal": False,
            "count": 1, "flops": 0.0, "bytes": fwd_bytes},
           {"op": "add", "phase": "bwd", "kind": "memory", "dims": [], "dtype": "float32", "causal": False,
            "count": 1, "flops": 0.0, "bytes": bwd_bytes}]
    return {"ops": ops, "axis_bytes": axis_bytes, "collectives": collectives}


def test_job_time_is_slowest_stage_plus_bubble_and_exposed_comm():
    """pp2 x dp2 (ZeRO-1), 4 microbatches, 1F1B, on 4 H100 of one node: a stage's busy time is its
    compute + its pp sends (blocking) + the dp reduction beyond the last microbatch's backward;
    the job adds (p - 1) x the slowest stage's per-microbatch forward + backward."""
    cfg = load_config("debug", {"parallel.pp": 2, "parallel.zero_stage": 1}, world_size=4)
    hbm = H100.hbm_bytes_per_s * HOP.hbm_efficiency
    link = H100.intra_node_bytes_per_s * BANDWIDTH_EFFICIENCY
    lat = H100.intra_node_latency_s
    gb = 1e9
    a = _role(4 * gb, 8 * gb, {"pp": 2 * gb, "dp_shard": 9 * gb}, {"pp": {"send": 4, "recv": 4}, "dp_shard": {"rs": 2}})
    b = _role(2 * gb, 4 * gb, {"pp": 2 * gb}, {"pp": {"send": 4, "recv": 4}})
    out = job_time([a, b], cfg, 4, "H100", 4)
    fa, ba = 4 * gb / hbm, 8 * gb / hbm
    pp_a = 2 * gb / link + 8 * lat
    dp_a = max(0.0, 9 * gb / link + 2 * lat - ba / 4)
    busy_a = fa + ba + pp_a + dp_a
    assert math.isclose(a["time"]["busy_s"], busy_a, rel_tol=1e-12)
    assert math.isclose(a["time"]["comm_exposed_s"], pp_a + dp_a, rel_tol=1e-12)
    mb = (fa + ba + pp_a) / 4  # the slowest stage's microbatch, its blocking comm shared in
    assert math.isclose(out["bubble_s"], (2 - 1) * mb, rel_tol=1e-12)
    assert math.isclose(out["step_s"], busy_a + mb, rel_tol=1e-12)
    assert b["time"]["busy_s"] < a["time"]["busy_s"]
