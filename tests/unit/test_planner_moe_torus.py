"""the expert all-to-all split by link, node-limited routing, fp8 dispatch,
overlap and load imbalance; collectives on a TPU 3-D torus against a switched fabric. Every
expected value is computed here by hand from the formulas in the docstrings."""
from __future__ import annotations

from dataclasses import replace

import pytest

from ndtrain.planner.comm import Links, moe_all_to_all
from ndtrain.planner.hardware import BANDWIDTH_EFFICIENCY, COMPUTE_EFFICIENCY, Cluster, get_accelerator
from ndtrain.planner.layout import Layout, Workload
from ndtrain.planner.model_spec import ModelSpec
from ndtrain.planner.torus import group_dims, torus_collective_time, torus_shape

# DeepSeek-V3-like MoE block shapes: h = 7168, 256 experts of 2048, top-8, one shared expert
SPEC = ModelSpec("moe", 129280, 7168, 4, 128, 128, 128, 18432, n_experts=256, top_k=8,
                 moe_ffn_hidden=2048, n_shared_experts=1, shared_ffn_hidden=2048)
H100 = get_accelerator("H100")
S = 4096  # tokens of one microbatch on one rank
HIER = Layout(dp_shard=512, ep=64, moe_dispatch="hierarchical")  # DeepSeek-V3's two-level dispatch


def _a2a(lay: Layout, **w):
    return moe_all_to_all(SPEC, Cluster(H100, 512), Workload(seq_len=4096, **w), lay, S)


def test_uniform_routing_splits_bytes_by_link():
    """ep = 64 over 8 nodes of 8: a copy stays on this node with probability 8/64 (1/64 on this rank)."""
    r = _a2a(Layout(dp_shard=512, ep=64))
    copy = S * 8 * 7168 * 2  # top-8 copies of width h in bf16
    assert r["ep_inter_bytes"] == pytest.approx(2 * copy * 56 / 64)  # dispatch + combine
    assert r["ep_intra_bytes"] == pytest.approx(2 * copy * 7 / 64)
    one = max(copy * 7 / 64 / (450e9 * BANDWIDTH_EFFICIENCY) + 7 * 3e-6,
              copy * 56 / 64 / (50e9 * BANDWIDTH_EFFICIENCY) + 7 * 10e-6)
    assert r["ep_fwd_raw"] == pytest.approx(2 * one) and r["ep_bwd_raw"] == pytest.approx(2 * one)
    # inside one node: nothing crosses the NIC
    r8 = _a2a(Layout(dp_shard=512, ep=8))
    assert r8["ep_inter_bytes"] == 0 and r8["ep_intra_bytes"] == pytest.approx(2 * copy * 7 / 8)


def test_node_limited_routing_halves_inter_node_bytes():
    """DeepSeek-V3's M = 4 nodes per token with hierarchical dispatch: each token crosses the NIC
    once per remote node it reaches, 4 * 7/8 = 3.5 token widths instead of 8 * 56/64 = 7 copies."""
    free = _a2a(Layout(dp_shard=512, ep=64))
    lim = _a2a(HIER, moe_max_nodes=4)
    assert lim["ep_inter_bytes"] == pytest.approx(2 * S * 7168 * 2 * 4 * 7 / 8)
    assert lim["ep_inter_bytes"] / free["ep_inter_bytes"] == pytest.approx(0.5)
    assert lim["ep_intra_bytes"] == pytest.approx(2 * S * 8 * 7168 * 2 * 7 / 8)  # NVLink forwarding
    assert lim["ep_fwd_raw"] < free["ep_fwd_raw"]
    m2 = _a2a(HIER, moe_max_nodes=2)
    assert m2["ep_inter_bytes"] / lim["ep_inter_bytes"] == pytest.approx(0.5)


def test_fp8_dispatch_and_imbalance():
    base = _a2a(HIER, moe_max_nodes=4)
    fp8 = _a2a(HIER, moe_max_nodes=4, moe_fp8_dispatch=True)
    per_byte = S * 7168 * 4 * 7 / 8  # inter-node bytes per byte of element width
    assert fp8["ep_inter_bytes"] == pytest.approx(per_byte * (1 + 4 / 128) + per_byte * 2)
    assert fp8["ep_bwd_raw"] == pytest.approx(base["ep_bwd_raw"])  # backward stays bf16
    assert fp8["ep_fwd_raw"] < base["ep_fwd_raw"]
    hot = _a2a(HIER, moe_max_nodes=4, moe_imbalance=1.5)
    assert hot["ep_fwd_raw"] == pytest.approx(1.5 * base["ep_fwd_raw"])


def test_overlap_with_shared_expert_and_dualpipev():
    r = _a2a(Layout(dp_shard=512, ep=64))
    rate = H100.peak("bfloat16") * COMPUTE_EFFICIENCY
    shared = 2 * S * 3 * 7168 * 2048 / rate  # the shared expert's forward GEMMs on the local tokens
    assert r["ep_fwd"] == pytest.approx(max(0.0, r["ep_fwd_raw"] - shared))
    assert r["ep_bwd"] == pytest.approx(max(0.0, r["ep_bwd_raw"] - 2 * shared))
    dual = _a2a(Layout(dp_shard=64, pp=8, ep=64, pp_schedule="dualpipev"))
    assert dual["ep_fwd_raw"] == pytest.approx(r["ep_fwd_raw"])
    assert dual["ep_fwd"] < r["ep_fwd"]  # the other microbatch's whole layer hides more
    no_shared = moe_all_to_all(replace(SPEC, n_shared_experts=0), Cluster(H100, 512),
                               Workload(seq_len=4096), Layout(dp_shard=512, ep=64), S)
    assert no_shared["ep_fwd"] == pytest.approx(no_shared["ep_fwd_raw"])  # nothing to hide behind


def test_torus_shapes_and_groups():
    assert torus_shape(64) == (4, 4, 4) and torus_shape(4096) == (16, 16, 16)
    assert torus_shape(6144) == (16, 16, 24) and torus_shape(512) == (8, 8, 8)
    shape = (16, 16, 16)
    assert group_dims(16, 16, shape) == [(16, 1)]  # one x ring
    assert group_dims(256, 256, shape) == [(16, 1), (16, 1)]  # an x-y plane
    assert group_dims(64, 4, shape) == [(4, 1)]  # stride 16 steps over x: 4 chips along y
    assert group_dims(8, 4, shape) == [(4, 2)]  # stride 2 along x: two rings share the links


def test_torus_versus_switched_all_reduce_documented_example():
    """docs/planner.md: 1 GB all-reduced over a TPU v4 4x4x4 cube (50 GB/s per link per direction,
    6 links = the chip's 300 GB/s) against a switched fabric giving each chip the same 300 GB/s.
    Torus, dimension-ordered: 2 * 3/4 * (V + V/4 + V/16) / 100 GB/s = 19.7 ms; switched ring:
    2 * 63/64 * V / 300 GB/s = 6.6 ms, 3x faster: only one dimension's 2 links carry each phase."""
    V, link = 1e9, 50e9
    torus = torus_collective_time("all_reduce", V, group_dims(64, 64, (4, 4, 4)), link)
    assert torus == pytest.approx(2 * 0.75 * (V + V / 4 + V / 16) / (2 * link))
    assert torus == pytest.approx(0.0196875)
    switched = 2 * 63 / 64 * V / (6 * link)
    assert torus / switched == pytest.approx(0.0196875 / 0.0065625)
    # one torus axis of n: 2(n-1)/n of the data over that dimension's two links
    assert torus_collective_time("all_reduce", V, [(16, 1)], link) == pytest.approx(2 * 15 / 16 * V / 100e9)
    # all-to-all on a ring of 4: hop-bytes V (1 + 2 + 1) over 2n = 8 link directions
    assert torus_collective_time("all_to_all", V, [(4, 1)], link) == pytest.approx(V * 4 / (4 * 2 * link))


def test_tpu_cluster_uses_the_torus():
    acc = get_accelerator("TPUv4")
    cluster = Cluster(acc, 64)
    lay = Layout(dp_shard=64)
    got = Links(cluster, lay).time("all_reduce", "dp_shard_cp", 1e9, 64)
    link = acc.intra_node_bytes_per_s / 6
    want = torus_collective_time("all_reduce", 1e9, [(4, 1), (4, 1), (4, 1)], link,
                                 acc.intra_node_latency_s, BANDWIDTH_EFFICIENCY)
    assert got == pytest.approx(want)
    gpu = Links(Cluster(get_accelerator("H100"), 64), lay).time("all_reduce", "dp_shard_cp", 1e9, 64)
    assert gpu != pytest.approx(got)


def test_hierarchical_dispatch_dedup_factor_and_flat_sends_every_copy():
    """Flat dispatch sends every copy, node-limited routing or not; hierarchical sends a token once
    per remote node it reaches. Without a node limit that is (N - 1)(1 - C(E - E/N, k) / C(E, k))
    remote nodes: 256 experts over 8 nodes, top-8: 7 x (1 - C(224, 8) / C(256, 8)) = 4.63 widths
    against 7 copies, a factor 0.66."""
    import math

    from ndtrain.planner.comm import remote_nodes_per_token

    flat = _a2a(Layout(dp_shard=512, ep=64))
    assert _a2a(Layout(dp_shard=512, ep=64), moe_max_nodes=4)["ep_inter_bytes"] == flat["ep_inter_bytes"]
    hier = _a2a(HIER)
    r = 7 * (1 - math.comb(224, 8) / math.comb(256, 8))
    assert remote_nodes_per_token(SPEC, 8) == pytest.approx(r) and 4.6 < r < 4.7
    assert hier["ep_inter_bytes"] == pytest.approx(2 * S * 7168 * 2 * r)
    assert hier["ep_inter_bytes"] / flat["ep_inter_bytes"] == pytest.approx(r / (8 * 56 / 64))
    assert hier["ep_fwd_raw"] < flat["ep_fwd_raw"]  # the NIC is the bottleneck: fewer bytes, less time
    # inside one node the two schemes are the same traffic: nothing crosses the NIC
    one = _a2a(Layout(dp_shard=512, ep=8, moe_dispatch="hierarchical"))
    assert one["ep_inter_bytes"] == 0


def test_qwen3_235b_folded_expert_mesh_is_expressible_and_costed():
    """Megatron's Qwen3-235B-A22B layout on 256 H100: attention TP2 x DP16 with PP8, experts EP32
    with expert-TP 1 over the same 32 ranks of each stage (MoE Parallel Folding, Liu et al. 2025)."""
    from ndtrain.planner.comm import axis_spans, estimate_axis_comm
    from ndtrain.planner.layout import check_layout, parse_layout
    from ndtrain.planner.search import evaluate

    qwen = ModelSpec("qwen3-235b-a22b", 151936, 4096, 94, 64, 4, 128, 0, n_experts=128, top_k=8,
                     moe_ffn_hidden=1536, qk_norm=True)
    w = Workload(seq_len=4096, global_batch_tokens=1024 * 4096)
    lay = parse_layout("tp=2,pp=8,dp_shard=16,ep=32,expert_tp=1,zero_stage=1,ac=full,pp_schedule=interleaved,"
                       "pp_virtual_stages=2")
    assert lay.folded and lay.etp == 1 and lay.expert_dp == 1 and "expert_tp=1" in str(lay)
    assert check_layout(qwen, 256, w, lay, runtime=False) == []
    tied = parse_layout("tp=2,pp=8,dp_shard=16,ep=32,zero_stage=1,ac=full")
    assert any("ep" in e for e in check_layout(qwen, 256, w, tied, runtime=False))  # ep > dp_shard x cp
    bad = parse_layout("tp=2,pp=8,dp_shard=16,ep=64,expert_tp=1")
    assert check_layout(qwen, 256, w, bad, runtime=False) == [
        "ep*expert_tp (64) does not divide the ranks of a pp stage (dp_replicate*dp_shard*cp*tp = 32): "
        "ep*expert_tp*edp*pp must equal world_size"]
    assert axis_spans(lay)["ep"] == 32  # 4 nodes of 8: the NIC carries 3/4 of the copies
    cl = Cluster(H100, 256)
    c = estimate_axis_comm(qwen, cl, w, lay, {"dense": 1e9, "expert": 1e9, "layers": 12, "moe_layers": 12})
    tokens = 4096 / 2  # the tp pair's tokens split over its two expert-TP groups
    assert c["ep_inter_bytes"] == pytest.approx(2 * tokens * 8 * 4096 * 2 * 24 / 32)
    plan = evaluate(qwen, cl, w, lay)
    assert plan.step.parts["ep_comm"] > 0 and plan.step.step_time_s > 0


def test_tp_inside_a_torus_overlaps_with_the_layers_gemms():
    """On a TPU slice TP hides behind the layer's GEMMs (collective matmul): the exposed TP time is
    the per-layer excess of the collective over the GEMMs, and never above v2's fully exposed
    forward; the same layout on a switched fabric keeps the forward collectives exposed."""
    from ndtrain.planner.compute import stage_op_times
    from ndtrain.planner.layout import parse_layout
    from ndtrain.planner.model_spec import load_model_spec
    from ndtrain.planner.timing import estimate_step_time
    from ndtrain.planner.torus import in_slice_tp, torus_tp_exposed

    spec, _ = load_model_spec("llama3_8b")
    acc = get_accelerator("TPUv5p")
    cl, w = Cluster(acc, 64), Workload(seq_len=8192, global_batch_tokens=64 * 8192)
    lay = parse_layout("tp=4,dp_shard=16,zero_stage=1")
    assert in_slice_tp(cl, lay) and not in_slice_tp(Cluster(H100, 64), lay)
    st = estimate_step_time(spec, cl, w, lay)
    ops, _ = stage_op_times(spec, cl, 8192, lay, 32, 0, True)
    f, b = torus_tp_exposed(st.raw_comm["tp_fwd"], st.raw_comm["tp_bwd"], ops.gemm_fwd / 32, ops.gemm_bwd / 32)
    assert st.parts["tp_comm"] == pytest.approx(st.microbatches * 32 * (f + b))
    assert st.parts["tp_comm"] < st.microbatches * 32 * st.raw_comm["tp_fwd"]  # not charged as exposed
    assert torus_tp_exposed(3.0, 5.0, 1.0, 6.0) == (2.0, 0.0)
    gpu = estimate_step_time(spec, Cluster(H100, 64), w, lay)
    assert gpu.parts["tp_comm"] >= gpu.microbatches * 32 * gpu.raw_comm["tp_fwd"] * 0.999


def test_shared_overlap_off_exposes_the_dispatch_and_reaches_the_config():
    from ndtrain.planner.layout import parallel_config, parse_layout

    on = _a2a(Layout(dp_shard=512, ep=64))
    off = _a2a(Layout(dp_shard=512, ep=64, moe_shared_overlap=0))
    assert off["ep_fwd_raw"] == on["ep_fwd_raw"] and off["ep_fwd"] == off["ep_fwd_raw"] > on["ep_fwd"]
    lay = parse_layout("dp_shard=512,ep=64,moe_shared_overlap=1")
    assert parallel_config(lay).moe_shared_overlap is True and "moe_shared_overlap=1" in str(lay)
    assert not parallel_config(Layout(dp_shard=512, ep=64)).moe_shared_overlap  # -1: the config's default
