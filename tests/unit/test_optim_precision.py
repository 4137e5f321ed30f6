"""Global-norm clipping and fp16 overflow checks take their cross-rank reductions from the caller.

References: closed-form norms of hand-built gradients; a fake reduction that plays the role of 3
identical ranks (multiplies by 3) shows that each group of shard axes is reduced once and that the
clip factor uses the reduced norm. ``optim.py`` and ``precision.py`` import nothing from
``ndtrain.parallel`` (checked on their import statements).
"""
from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

import ndtrain
from ndtrain.config import TrainingConfig
from ndtrain.optim import build_optimizer, clip_coefficient, clip_grad_norm, grad_sum_sq
from ndtrain.precision import LossScaler


def test_clip_grad_norm_reduces_each_axes_group_once_and_clips_with_the_global_norm():
    g_rep = torch.full((4,), 1.0, dtype=torch.float64)  # replicated: 4
    g_tp = torch.full((2, 2), 2.0, dtype=torch.float64)  # split over tp: 16 here, x3 over "ranks"
    g_tp2 = torch.full((1,), 3.0, dtype=torch.float64)  # same axes group: 9, x3
    calls = []

    def reduce_sum(sq, axes):
        calls.append(axes)
        if axes:
            sq.mul_(3)

    norm = clip_grad_norm([(g_rep, ()), (g_tp, ("tp",)), (g_tp2, ("tp",))], 1.0, reduce_sum)
    want = math.sqrt(4 + 3 * (16 + 9))
    assert norm == pytest.approx(want, rel=1e-15)
    assert calls == [(), ("tp",)]  # one reduction per group, sorted: same order on every rank
    coef = 1.0 / (want + 1e-6)
    assert clip_coefficient(want, 1.0) == coef and clip_coefficient(0.5, 1.0) == 1.0
    assert torch.equal(g_tp, torch.full((2, 2), 2.0 * coef, dtype=torch.float64))
    assert clip_coefficient(want, 0.0) == 1.0  # 0 disables clipping
    with pytest.raises(ValueError, match="reduce_sum"):
        clip_grad_norm([(g_tp, ("tp",))], 1.0)


def test_clip_grad_norm_scales_uncounted_gradients_without_counting_them():
    """A copy of a gradient counted elsewhere (a pipeline's last-stage tied head): left out of the
    norm (3-4-5 triangle: the norm is 5, not sqrt(25 + 144)), multiplied by the same factor."""
    g = torch.tensor([3.0, 4.0], dtype=torch.float64)
    dup = torch.tensor([12.0], dtype=torch.float64)
    norm = clip_grad_norm([(g, ())], 1.0, None, uncounted=[dup])
    coef = 1.0 / (5.0 + 1e-6)
    assert norm == 5.0
    assert torch.equal(g, torch.tensor([3.0 * coef, 4.0 * coef], dtype=torch.float64))
    assert torch.equal(dup, torch.tensor([12.0 * coef], dtype=torch.float64))
    free = torch.tensor([7.0], dtype=torch.float64)
    assert clip_grad_norm([], 1.0, None, uncounted=[free]) == 0.0 and free.item() == 7.0  # norm 0: no clip


def test_grad_sum_sq_is_float64_accurate_for_float32_and_exact_for_float64_gradients():
    """Reference: the float64 sum of squares of the float64 copies. A 2M-element float32 tensor is
    where a whole-tensor float32 norm drifts (~3e-5 relative on CPU, as torch's clip_grad_norm_);
    the sliced norms must stay within 1e-6. float64 gradients agree to rounding; bf16 ones are
    accumulated in float32 (their own dtype would round the result to 3 significant digits)."""
    gen = torch.Generator().manual_seed(0)
    big = torch.randn(2**21, generator=gen, dtype=torch.float32) * 1e-3
    small = torch.randn(256, 3, generator=gen, dtype=torch.float32)
    exact = sum(float(g.double().pow(2).sum()) for g in (big, small))
    got = grad_sum_sq([big, small])
    assert got.dtype == torch.float64 and got.shape == (1,)
    assert abs(got.item() - exact) / exact < 1e-6
    big_exact = float(big.double().pow(2).sum())
    assert abs(grad_sum_sq([big]).item() - big_exact) / big_exact < 1e-6
    whole = float(torch.linalg.vector_norm(big).double() ** 2)
    assert abs(whole - big_exact) / big_exact > 1e-5  # the drift the slicing removes (the test can fail)
    g64 = [big.double(), small.double()]
    assert grad_sum_sq(g64).item() == pytest.approx(exact, rel=1e-13)
    b16 = small.bfloat16()
    assert grad_sum_sq([b16]).item() == pytest.approx(float(b16.double().pow(2).sum()), rel=1e-6)
    mixed = grad_sum_sq([big, b16, torch.empty(0)])  # dtypes grouped, empty tensors add 0
    assert mixed.item() == pytest.approx(float(big.double().pow(2).sum() + b16.double().pow(2).sum()), rel=1e-6)
    assert grad_sum_sq([]).item() == 0.0


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-6), (torch.float64, 1e-13)])
def test_build_optimizer_is_fused_adamw_on_cpu_and_matches_foreach(dtype, rtol):
    """Reference: torch's foreach AdamW with the same groups and hyperparameters, 5 steps on the
    same gradients; the fused kernel reorders the arithmetic only (rounding-level differences)."""
    gen = torch.Generator().manual_seed(0)
    init = {"w": torch.randn(64, 32, generator=gen, dtype=dtype), "b": torch.randn(32, generator=gen, dtype=dtype)}
    grads = [{k: torch.randn(v.shape, generator=gen, dtype=dtype) for k, v in init.items()} for _ in range(5)]
    cfg = TrainingConfig(lr=1e-2, weight_decay=0.1)
    runs = []
    for fused in (True, False):
        params = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
        opt = build_optimizer(params.items(), cfg, eager_state=True)
        assert opt.param_groups[0]["fused"] is True and len(opt.param_groups) == 2  # 1-D: no decay
        if not fused:
            groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in opt.param_groups]
            opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=True)
            assert not opt.param_groups[0]["fused"]
        for g in grads:
            for k, p in params.items():
                p.grad = g[k].clone()
            opt.step()
        runs.append(params)
    for k in init:
        torch.testing.assert_close(runs[0][k], runs[1][k], rtol=rtol, atol=0)
        assert not torch.equal(runs[0][k], init[k])  # the steps moved the weights


def test_loss_scaler_takes_the_overflow_flag_reduction_from_the_caller():
    scaler = LossScaler(init_scale=4.0)
    g = torch.full((3,), 8.0)
    other_rank_overflowed = lambda flag: flag.fill_(1.0)
    assert not scaler.unscale_and_check([g], other_rank_overflowed)
    assert torch.equal(g, torch.full((3,), 8.0))  # not unscaled when the step is skipped
    assert scaler.unscale_and_check([g], lambda flag: None)
    assert torch.equal(g, torch.full((3,), 2.0))
    assert not scaler.unscale_and_check([torch.tensor([float("inf")])])  # one process: no reduce


@pytest.mark.parametrize("module", ["optim/adamw.py", "optim/muon.py", "optim/schedule.py", "optim/clip.py",
                                    "precision.py"])
def test_optim_and_precision_do_not_import_the_parallel_layer(module):
    tree = ast.parse((Path(ndtrain.__file__).parent / module).read_text())
    names = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    names += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert names and not [m for m in names if m.startswith("ndtrain.parallel")], names
