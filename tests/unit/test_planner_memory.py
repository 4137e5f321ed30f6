"""Activation memory (Korthikanti 2022 adapted to SwiGLU / GQA), checkpointing policies, pipeline
in-flight microbatches, ZeRO placement of model state."""
import pytest

from ndtrain.planner.hardware import Cluster, GiB, get_accelerator
from ndtrain.planner.layout import Layout, Workload
from ndtrain.planner.memory import estimate_activation_bytes_per_layer, recompute_fraction
from ndtrain.planner.model_spec import load_model_spec
from ndtrain.planner.pipeline import bubble_fraction, inflight_microbatches, partition_layers, rank_layers
from ndtrain.planner.search import evaluate

SPEC_405B, _ = load_model_spec("llama3_405b")
SPEC_8B, _ = load_model_spec("llama3_8b")


def act(spec, tokens=8192, seq=8192, **kw):
    return estimate_activation_bytes_per_layer(spec, tokens, seq, **kw)["total"]


def test_llama3_405b_layer_coefficient():
    """Per layer, bf16, flash, TP t with SP: 2sbh (norm in) + 2sbh (QKV in) + 2sbh (Q) + 0.25sbh
    (K, V: 8 of 128 heads) + 2sbh (O) + 2sbh + 2sbh (MLP norm / in) + 3 x 2sbf (gate, up, SiLU*up),
    f = 3.25h: 31.75 sbh/t bytes (Korthikanti's GPT figure is 34 sbh/t with dropout and a 4h MLP)."""
    t, s, h = 8, 8192, 16384
    per = estimate_activation_bytes_per_layer(SPEC_405B, s, s, tp=t, sp=True)
    lse = 4 * s * 128 / t  # fp32 logsumexp per query and head
    assert (per["total"] - lse) / (s * h / t) == pytest.approx(31.75)
    assert per["input"] == 2 * s * h / t


def test_sequence_parallel_divides_everything_by_t():
    base = act(SPEC_8B, tp=1)
    for t in (2, 4, 8):
        assert act(SPEC_8B, tp=t, sp=True) == pytest.approx(base / t)
    # without SP the four replicated residual-stream tensors (8 sbh bytes) are not divided
    s, h = 8192, 4096
    no_sp = act(SPEC_8B, tp=8, sp=False)
    assert no_sp - act(SPEC_8B, tp=8, sp=True) == pytest.approx(8 * s * h * (1 - 1 / 8))


def test_gqa_kv_replicated_when_tp_exceeds_kv_heads():
    # 8 kv heads: at tp=16 each rank still holds one kv head
    k8 = estimate_activation_bytes_per_layer(SPEC_405B, 8192, 8192, tp=8, sp=True)["attention"]
    k16 = estimate_activation_bytes_per_layer(SPEC_405B, 8192, 8192, tp=16, sp=True)["attention"]
    kv = 2 * 2 * 8192 * 128  # K and V of one head, bf16
    assert k16 == pytest.approx(k8 / 2 + kv / 2)


def test_no_flash_stores_scores_and_selective_drops_them():
    s = 4096
    flash = act(SPEC_8B, s, s)
    naive = act(SPEC_8B, s, s, flash=False)
    assert naive - flash == pytest.approx(2 * 32 * s * s - 4 * s * 32)  # bf16 softmax out vs lse
    sel = act(SPEC_8B, s, s, flash=False, policy="selective")
    assert sel < flash  # scores and SiLU(g)*u recomputed
    assert flash - act(SPEC_8B, s, s, policy="selective") == pytest.approx(2 * s * 14336)


def test_inflight_microbatches():
    assert inflight_microbatches(1, 32) == 1
    assert inflight_microbatches(16, 32, "1f1b") == 16  # the first stage holds p
    assert inflight_microbatches(16, 32, "1f1b", stage=15) == 1
    assert inflight_microbatches(4, 2, "1f1b") == 2
    assert inflight_microbatches(4, 32, "gpipe") == 32
    # interleaved: p (1 + (p-1)/(p v)) (Korthikanti 2022 / Narayanan 2021)
    assert inflight_microbatches(16, 32, "interleaved", v=8) == pytest.approx(16 * (1 + 15 / 128))
    assert inflight_microbatches(4, 8, "zero_bubble") == 4


def test_bubble_fractions():
    assert bubble_fraction(1, 4) == 0
    assert bubble_fraction(8, 1) == pytest.approx(7 / 8)
    assert bubble_fraction(4, 4, "1f1b") == pytest.approx(3 / 7)
    assert bubble_fraction(16, 32, "interleaved", 8) == pytest.approx(15 / (256 + 15))
    assert bubble_fraction(4, 8, "zero_bubble") < bubble_fraction(4, 8, "1f1b")


def test_partition_balances_head():
    assert partition_layers(32, 4) == [8, 8, 8, 8]
    parts = partition_layers(126, 16, head_cost=0.7)
    assert sum(parts) == 126 and max(parts) == 8 and parts[-1] < 8
    with pytest.raises(ValueError):
        partition_layers(4, 8)


def _plan(spec, gpus, seq, batch, layout, **kw):
    return evaluate(spec, Cluster(get_accelerator("H100"), gpus), Workload(seq, batch, **kw), layout)


def test_checkpoint_policies_order_memory_and_recompute():
    mems = {}
    for ac in ("none", "selective", "every:4", "every:2", "sqrt", "full"):
        p = _plan(SPEC_8B, 8, 8192, 64 * 8192, Layout(dp_shard=8, zero_stage=3, ac=ac, microbatch=2))
        mems[ac] = p.memory.breakdown["activations"]
    # every:C checkpoints one block in C; sqrt: C = round(sqrt 32) = 6
    assert mems["none"] > mems["sqrt"] > mems["every:4"] > mems["every:2"] > mems["full"]
    assert mems["none"] > mems["selective"] > mems["full"]
    assert recompute_fraction("full", 32) == 1 and recompute_fraction("every:4", 32) == 0.25
    assert recompute_fraction("none", 32) == 0 == recompute_fraction("selective", 32)
    hfu = {ac: _plan(SPEC_8B, 8, 8192, 64 * 8192, Layout(dp_shard=8, zero_stage=3, ac=ac))
           for ac in ("none", "full")}
    assert hfu["none"].hfu == pytest.approx(hfu["none"].mfu)
    assert hfu["full"].hfu == pytest.approx(hfu["full"].mfu * 4 / 3)  # + one forward
    assert hfu["full"].step.step_time_s > hfu["none"].step.step_time_s


def test_zero_stages_shard_state_over_dp_shard_times_cp():
    mem = {}
    for z in (0, 1, 2, 3):
        p = _plan(SPEC_8B, 64, 8192, 512 * 8192, Layout(tp=2, cp=2, dp_shard=16, zero_stage=z))
        mem[z] = p.memory.breakdown
    n = SPEC_8B.params_total / 2  # tp=2
    assert mem[0]["optimizer"] == pytest.approx(12 * n, rel=0.01)
    assert mem[1]["optimizer"] == pytest.approx(12 * n / 32, rel=0.01)  # dp_shard x cp = 32
    assert mem[2]["grads"] == pytest.approx(2 * n / 32, rel=0.01)
    assert mem[3]["params"] == pytest.approx(2 * n / 32, rel=0.01) and mem[3]["zero3_buffers"] > 0


def test_gpipe_holds_all_microbatches():
    lay = {"pp": 4, "dp_shard": 2, "zero_stage": 1, "microbatch": 1}
    g = _plan(SPEC_8B, 8, 8192, 64 * 8192, Layout(pp_schedule="gpipe", **lay))
    f = _plan(SPEC_8B, 8, 8192, 64 * 8192, Layout(pp_schedule="1f1b", **lay))
    ratio = g.memory.breakdown["activations"] / f.memory.breakdown["activations"]
    blocks = [len(r["layers"]) for r in rank_layers(SPEC_8B, 4, 1, "1f1b", 8192)]  # the trainer's split
    # GPipe: m = 32 on every rank, the peak on the rank with most blocks; 1F1B: p = 4 on rank 0
    assert f.memory.stage == 0 and ratio == pytest.approx(32 * max(blocks) / (4 * blocks[0]))
    assert g.step.step_time_s == pytest.approx(f.step.step_time_s)


def test_fits_against_capacity():
    p = _plan(SPEC_405B, 8, 8192, 8 * 8192, Layout(dp_shard=8))
    assert not p.fits and p.memory.total > 80 * GiB
    assert p.memory.capacity == get_accelerator("H100").hbm_bytes


@pytest.mark.parametrize("p,v", [(2, 2), (4, 2), (4, 3), (8, 4)])
def test_grad_share_at_peak_follows_the_interleaved_schedule(p, v):
    """The share of a rank's gradients present at its activation peak, against ndtrain's own
    interleaved action lists: at the last action that leaves the most chunk-forwards outstanding
    (the peak, before the backwards that free them), the chunks that have had a backward."""
    from ndtrain.parallel.pp.schedules import interleaved
    from ndtrain.planner.pipeline import grad_share_at_peak

    for m in (p, p + 1, 2 * p, 3 * p + 1):
        sched = interleaved(p, m, v)
        for r in range(p):
            live, top, share = 0, -1, 0.0
            seen: set[int] = set()
            for a in sched.actions[r]:
                live += 1 if a.kind == "F" else -1
                if a.kind == "B":
                    seen.add(a.chunk)
                if a.kind == "F" and live >= top:
                    top, share = live, len(seen) / v
            assert grad_share_at_peak(p, m, "interleaved", v, r) == pytest.approx(share), (m, r)
