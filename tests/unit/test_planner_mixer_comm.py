"""The planner's context-parallel traffic per token mixer (``planner.mixer_comm``) on Qwen3-Next
80B (Gated DeltaNet 3:1 softmax): state passing does not grow with T, the ring does, and the step
time's cp part follows the mixers. Exact bytes against a trained hybrid's counted traffic:
``tests/parallel/test_mixers_cp.py``."""
import pytest

from ndtrain.planner.hardware import Cluster, get_accelerator
from ndtrain.planner.layout import Workload, parse_layout
from ndtrain.planner.mixer_comm import cp_layer_bytes
from ndtrain.planner.model_spec import load_model_spec
from ndtrain.planner.timing import estimate_step_time


def test_deltanet_state_passing_is_independent_of_t_and_the_ring_is_not():
    spec, _ = load_model_spec("qwen3_next_80b")
    # one sequence at cp 4, bf16: 3 states of H_v 32 x K 128 x (K + V) 256 in float32 each way,
    # and the conv halo, 3 inputs of 2 H_k K + H_v V = 8,192 channels in bf16
    state = 3 * 32 * 128 * 256 * 4
    halo = 3 * 8192 * 2
    for t in (32768, 131072):
        assert cp_layer_bytes(spec, "gated_deltanet", 1, t, 4, e=2) == (state + halo, state + halo)
    assert cp_layer_bytes(spec, "gated_deltanet", 1, t, 4, e=2, position="first") == (state + halo, state)
    # the softmax layer's ring: 3 hops of [K | V] (2 kv heads x T/4 x 512, bf16); backward 3 again
    # plus 4 float32 dK / dV accumulators
    for t in (32768, 131072):
        block = 2 * (t // 4) * 512
        assert cp_layer_bytes(spec, "attention", 1, t, 4, e=2) == (3 * block * 2, 3 * block * 2 + 4 * block * 4)
    assert cp_layer_bytes(spec, "gated_deltanet", 1, 4096, 1) == (0.0, 0.0)
    with pytest.raises(ValueError, match="position"):
        cp_layer_bytes(spec, "gated_deltanet", 1, 4096, 4, position="middle rank")


def test_cp_time_follows_the_mixers():
    """The same layout on the hybrid and on its all-softmax twin (layer_pattern cleared), T = 128K:
    the hybrid moves less on cp (12 rings, 36 small state exchanges against 48 rings), but its
    exposed cp time is the larger: at 128K each ring hides under its attention block, while a
    state all-gather sits on the critical path (the composition waits for it)."""
    from dataclasses import replace

    spec, _ = load_model_spec("qwen3_next_80b")
    soft = replace(spec, mixers=None)
    cl = Cluster(get_accelerator("H100"), 64)
    lay = parse_layout("tp=8,cp=8,dp_shard=1")
    w = Workload(seq_len=131072, global_batch_tokens=131072, precision="mixed", act_bytes=2)
    hyb, twin = estimate_step_time(spec, cl, w, lay), estimate_step_time(soft, cl, w, lay)
    raw = [st.stage_layers * (st.raw_comm["cp_fwd"] + st.raw_comm["cp_bwd"]) for st in (hyb, twin)]
    assert 0 < raw[0] < 0.5 * raw[1]
    assert twin.parts["cp_comm"] == 0.0 < hyb.parts["cp_comm"] < raw[0]
