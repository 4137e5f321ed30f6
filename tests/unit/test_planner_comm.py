"""Alpha-beta collectives, the link each axis lands on, per-axis traffic of a layout."""
import pytest

from ndtrain.planner.comm import axis_spans, estimate_axis_comm, estimate_collective_time
from ndtrain.planner.hardware import Cluster, get_accelerator
from ndtrain.planner.layout import Layout, Workload, parse_layout
from ndtrain.planner.model_spec import load_model_spec
from ndtrain.planner.search import evaluate

H100 = get_accelerator("H100")
SPEC_8B, _ = load_model_spec("llama3_8b")


def test_collective_formulas():
    V, n, bw = 1e9, 8, 100e9
    assert estimate_collective_time("all_reduce", V, n, bw) == pytest.approx(2 * 7 / 8 * V / bw)
    assert estimate_collective_time("all_gather", V, n, bw) == pytest.approx(7 / 8 * V / bw)
    assert estimate_collective_time("reduce_scatter", V, n, bw) == pytest.approx(7 / 8 * V / bw)
    assert estimate_collective_time("all_to_all", V, n, bw) == pytest.approx(7 / 8 * V / bw)
    assert estimate_collective_time("send", V, 2, bw, 1e-5) == pytest.approx(V / bw + 1e-5)
    assert estimate_collective_time("all_reduce", V, 1, bw) == 0.0
    half = estimate_collective_time("all_reduce", V, n, bw, efficiency=0.5)
    assert half == pytest.approx(2 * 2 * 7 / 8 * V / bw)
    with pytest.raises(ValueError):
        estimate_collective_time("gossip", V, n, bw)


def test_tree_for_latency_ring_for_bandwidth():
    n, alpha, bw = 1024, 10e-6, 50e9
    small = estimate_collective_time("all_reduce", 1e3, n, bw, alpha)
    assert small == pytest.approx(2 * 1e3 / bw + 2 * 10 * alpha)  # tree: 2 log2(n) steps
    big = estimate_collective_time("all_reduce", 1e10, 8, bw, alpha)
    assert big == pytest.approx(2 * 7 / 8 * 1e10 / bw + 2 * 7 * alpha)  # ring


def test_axis_spans_tp_innermost():
    lay = Layout(tp=8, cp=2, pp=4, dp_shard=16, dp_replicate=2)
    spans = axis_spans(lay)
    assert spans["tp"] == 8 and spans["cp"] == 16 and spans["dp_shard_cp"] == 256
    assert spans["dp_replicate"] == 512 and spans["pp"] == lay.world == 2048
    cl = Cluster(H100, 2048)
    assert cl.link(spans["tp"])[0] == "intra-node"
    assert cl.link(spans["cp"])[0] == "inter-node"


def test_tp_traffic_with_and_without_sp():
    w = Workload(seq_len=4096, global_batch_tokens=64 * 4096)
    cl = Cluster(H100, 8).with_accelerator(intra_node_latency_s=0.0)
    stage = {"dense": 1e9, "expert": 0, "moe_layers": 0, "layers": 32}
    sp = estimate_axis_comm(SPEC_8B, cl, w, parse_layout("tp=8,dp_shard=1"), stage)
    nosp = estimate_axis_comm(SPEC_8B, cl, w, parse_layout("tp=8,dp_shard=1,sp=0"), stage)
    act = 2 * 4096 * 4096  # bf16 (T, C) tensor of one sequence
    bw = 450e9 * 0.85
    ag = 7 / 8 * act / bw
    assert sp["tp_fwd"] == pytest.approx(4 * ag, rel=0.01)  # 2 all-gathers + 2 reduce-scatters
    assert nosp["tp_fwd"] == pytest.approx(2 * 2 * ag, rel=0.01)  # 2 all-reduces: same bytes
    assert sp["links"] == {"tp": "intra-node"}


def test_dp_traffic_per_zero_stage():
    w = Workload(seq_len=4096, global_batch_tokens=64 * 4096)
    cl = Cluster(H100, 64)
    stage = {"dense": 8e9, "expert": 0, "moe_layers": 0, "layers": 32}
    c = {z: estimate_axis_comm(SPEC_8B, cl, w, Layout(dp_shard=64, zero_stage=z), stage) for z in range(4)}
    # ZeRO-1: reduce-scatter + all-gather = the all-reduce's bytes (the "free" memory win)
    assert c[1]["dp_grad"] + c[1]["dp_param"] == pytest.approx(c[0]["dp_grad"], rel=0.01)
    # ZeRO-2 moves the reduce-scatter into each microbatch's backward
    assert c[2]["zero_bwd"] == pytest.approx(c[1]["dp_grad"]) and c[2]["dp_grad"] == 0
    # ZeRO-3 (FSDP): gather for forward, again for backward, reduce-scatter: 1.5x the all-reduce
    z3 = c[3]["zero_fwd"] + c[3]["zero_bwd"]
    assert z3 == pytest.approx(1.5 * c[0]["dp_grad"], rel=0.01)
    assert c[0]["links"]["dp"] == "inter-node"


def test_hsdp_keeps_sharding_inside_the_node():
    w = Workload(seq_len=4096, global_batch_tokens=256 * 4096)
    spec = SPEC_8B
    fsdp = evaluate(spec, Cluster(H100, 64), w, Layout(dp_shard=64, zero_stage=3))
    hsdp = evaluate(spec, Cluster(H100, 64), w, Layout(dp_shard=8, dp_replicate=8, zero_stage=3))
    assert fsdp.step.links["dp"] == "inter-node" and hsdp.step.links["dp"] == "intra-node"
    assert hsdp.step.raw_comm["zero_fwd"] < fsdp.step.raw_comm["zero_fwd"] / 5
    opt = {k: p.memory.breakdown["optimizer"] for k, p in (("fsdp", fsdp), ("hsdp", hsdp))}
    assert opt["hsdp"] == pytest.approx(8 * opt["fsdp"], rel=0.01)


def test_context_parallel_impls():
    spec, _ = load_model_spec("llama3_405b")
    w = Workload(seq_len=131072, global_batch_tokens=128 * 131072)
    cl = Cluster(H100, 16384)
    base = "tp=8,cp=16,pp=16,dp_shard=8,zero_stage=2,pp_schedule=interleaved,pp_virtual_stages=8"
    lays = {impl: parse_layout(f"{base},cp_impl={impl}")
            for impl in ("ring", "allgather", "ulysses")}
    plans = {k: evaluate(spec, cl, w, v) for k, v in lays.items()}
    for p in plans.values():
        assert p.step.links["cp"] == "inter-node" and p.step.raw_comm["cp_fwd"] > 0
    # the ring hides its block exchanges behind 128K-token attention; all-gather is exposed
    assert plans["ring"].step.parts["cp_comm"] == 0.0
    assert plans["allgather"].step.parts["cp_comm"] > 0.0
