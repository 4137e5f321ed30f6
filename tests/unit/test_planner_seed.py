"""The seed lectures' arithmetic (lecture 11: distributed training / MFU; lecture 8: ZeRO), each
figure recomputed by the planner's own functions."""
import math

import pytest

from ndtrain.planner.comm import estimate_collective_time, ring_allreduce_bytes_per_rank
from ndtrain.planner.memory import PRECISIONS, estimate_state_bytes_per_param
from ndtrain.planner.model_spec import estimate_training_flops
from ndtrain.planner.pipeline import checkpoint_cost, pipeline_mfu_ceiling
from ndtrain.planner.timing import estimate_training_days

GB = 1e9


def test_four_numbers_times_two_bytes():
    # weight, gradient, Adam beta1 and beta2 statistics, 2 bytes each
    per = estimate_state_bytes_per_param(0, 1, "lower_bound")
    assert per["total"] == 8
    assert 1e9 * per["total"] == pytest.approx(8 * GB)  # 1B params ~ 8 GB
    assert 80 * GB / per["total"] == pytest.approx(10e9)  # an 80 GB GPU tops out near 10B params


def test_mixed_precision_adam_is_16_bytes():
    assert PRECISIONS["mixed"] == (2, 2, 12)  # bf16 weight, bf16 grad, fp32 master + m + v
    assert sum((2, 2, 4, 4, 4)) == estimate_state_bytes_per_param(0, 1, "mixed")["total"] == 16


def test_100b_params_sharded_over_80_ranks():
    total = 100e9 * estimate_state_bytes_per_param(0, 1, "lower_bound")["total"]
    assert total == pytest.approx(800 * GB)
    per_rank = 100e9 * estimate_state_bytes_per_param(3, 80, "lower_bound")["total"]
    assert per_rank == pytest.approx(10 * GB)


@pytest.mark.parametrize("stage,expected", [(0, 16.0), (1, 5.5), (2, 3.75), (3, 2.0)])
def test_zero_bytes_per_param_at_n8(stage, expected):
    # lecture 8: ZeRO-1 4 + 12/N, ZeRO-2 2 + 14/N, ZeRO-3 16/N (the ZeRO paper's 2 + 2 + K/N, K = 12)
    assert estimate_state_bytes_per_param(stage, 8, "mixed")["total"] == pytest.approx(expected)


def test_zero_conventions_differ_in_split_not_total():
    # ndtrain's trainer keeps fp32 weights and grads + Adam m, v: also 16 bytes, split 4 + 4 + 8
    fp32 = estimate_state_bytes_per_param(1, 8, "fp32")
    assert fp32["total"] == pytest.approx(4 + 4 + 8 / 8)
    assert estimate_state_bytes_per_param(0, 1, "fp32")["total"] == 16


def test_gradient_ring_allreduce_8_ranks():
    grads = 16 * GB  # an 8B model's bf16 gradients
    assert ring_allreduce_bytes_per_rank(grads, 8) == pytest.approx(28 * GB)
    t_nvlink = estimate_collective_time("all_reduce", grads, 8, 900 * GB)
    t_pod = estimate_collective_time("all_reduce", grads, 8, 50 * GB)
    assert t_nvlink == pytest.approx(0.031, abs=0.001)
    assert t_pod == pytest.approx(0.56, abs=0.005)


def test_8b_step_flops_and_time():
    flops = estimate_training_flops(8e9, 4 * 4096)
    assert flops == pytest.approx(7.9e14, rel=0.01)
    assert flops / 989e12 == pytest.approx(0.8, abs=0.01)
    # communication is ~4% of the step on NVLink, ~70% across pods
    assert 0.031 / 0.8 == pytest.approx(0.04, abs=0.005)
    assert 0.56 / 0.8 == pytest.approx(0.70, abs=0.01)


def test_llama3_405b_training_days():
    flops = estimate_training_flops(405e9, 15.6e12)
    assert flops == pytest.approx(3.8e25, rel=0.01)
    days = estimate_training_days(flops, 16384, 989.4e12, 0.40)
    assert days == pytest.approx(68, abs=1)
    assert estimate_training_days(flops, 16384, 989.4e12, 0.20) == pytest.approx(2 * days)


def test_pipeline_mfu_ceiling():
    assert pipeline_mfu_ceiling(8, 1) == pytest.approx(1 / 8)
    assert pipeline_mfu_ceiling(4, 4) == pytest.approx(4 / 7)
    with pytest.raises(ValueError):
        pipeline_mfu_ceiling(0, 4)


def test_sqrt_checkpointing_scaling():
    """Full recompute is O(N^2) compute, O(1) memory; storing everything O(N), O(N); sqrt(N)
    checkpoints O(N sqrt N) compute and O(sqrt N) memory: the ratios stay bounded as N grows."""
    for n in (16, 64, 256, 1024, 4096):
        c = math.isqrt(n)
        cost = checkpoint_cost(n, c)
        assert 0.4 < cost["compute"] / n**1.5 < 1.6
        assert 1.0 <= cost["memory"] / math.sqrt(n) <= 1.3
        assert checkpoint_cost(n, 1)["compute"] == n + n * (n - 1) // 2  # O(N^2)
        assert checkpoint_cost(n, 1)["memory"] == 2  # O(1)
        assert checkpoint_cost(n, n)["compute"] == n  # no recompute
    # the sqrt choice minimises compute x memory against both extremes
    n = 1024
    prod = {c: checkpoint_cost(n, c)["compute"] * checkpoint_cost(n, c)["memory"] for c in (1, 32, n)}
    assert prod[32] < prod[1] and prod[32] < prod[n]
