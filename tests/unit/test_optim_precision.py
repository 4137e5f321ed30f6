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
from ndtrain.optim import clip_coefficient, clip_grad_norm
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


def test_loss_scaler_takes_the_overflow_flag_reduction_from_the_caller():
    scaler = LossScaler(init_scale=4.0)
    g = torch.full((3,), 8.0)
    other_rank_overflowed = lambda flag: flag.fill_(1.0)
    assert not scaler.unscale_and_check([g], other_rank_overflowed)
    assert torch.equal(g, torch.full((3,), 8.0))  # not unscaled when the step is skipped
    assert scaler.unscale_and_check([g], lambda flag: None)
    assert torch.equal(g, torch.full((3,), 2.0))
    assert not scaler.unscale_and_check([torch.tensor([float("inf")])])  # one process: no reduce


@pytest.mark.parametrize("module", ["optim.py", "precision.py"])
def test_optim_and_precision_do_not_import_the_parallel_layer(module):
    tree = ast.parse((Path(ndtrain.__file__).parent / module).read_text())
    names = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    names += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert names and not [m for m in names if m.startswith("ndtrain.parallel")], names
