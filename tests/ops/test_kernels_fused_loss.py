"""``BatchPlan.fused_loss_sum``: the fused linear + cross-entropy loss, whole and vocab-parallel.

Reference: ``BatchPlan.loss_sum`` on the materialised logits (tp = 1), i.e. ``F.cross_entropy``.
Tolerance: relative 1e-5 in fp32 on the loss sum, dh and dW (summation order only). The tp = 2
check runs 2 gloo ranks, each holding half of a vocabulary padded from 250 to 256 rows (so rank 1
has 3 padded rows that must get no probability and no gradient); dh must come out summed over tp
(the same on both ranks), and the two dW shards concatenated must equal the whole dW.
"""
from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_ranks

pytest.importorskip("triton")

from ndtrain.config import Config, ModelConfig
from ndtrain.mesh import ParallelDims
from ndtrain.parallel.batch import BatchPlan
from tests.utils import rel_err

V, VP, C = 250, 256, 32


def _case(tp: int):
    cfg = Config(model=ModelConfig(vocab_size=V, dim=C, n_heads=4))
    cfg.parallel.tp, cfg.parallel.dp_shard = tp, 1
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 9, C, generator=g)
    w = torch.randn(VP, C, generator=g)
    w[V:] = 0.0
    labels = torch.randint(0, V, (2, 9), generator=g)
    labels[0, 2] = -100
    return cfg, h, w, labels


def _reference():
    cfg, h, w, labels = _case(1)
    plan = BatchPlan(ParallelDims().build_mesh(), cfg)
    h, w = h.requires_grad_(True), w.requires_grad_(True)
    loss = plan.loss_sum(h @ w[:V].t(), labels)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def test_fused_loss_sum_whole_vocab():
    cfg, h, w, labels = _case(1)
    ref = _reference()
    plan = BatchPlan(ParallelDims().build_mesh(), cfg, fused_impl="triton")
    h, w = h.requires_grad_(True), w.requires_grad_(True)
    loss = plan.fused_loss_sum(h, w, labels)  # padded rows V..VP ignored via vocab_size
    loss.backward()
    assert rel_err(loss, ref[0], "rms") <= 1e-5 and rel_err(h.grad, ref[1], "rms") <= 1e-5
    assert rel_err(w.grad, ref[2], "rms") <= 1e-5
    assert torch.equal(w.grad[V:], torch.zeros(VP - V, C))


def _tp_rank(rank: int, world: int):
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")
    cfg, h, w, labels = _case(world)
    mesh = ParallelDims(tp=world, world_size=world).build_mesh()
    plan = BatchPlan(mesh, cfg, fused_impl="triton")
    shard = VP // world
    h = h.requires_grad_(True)
    w_local = w[rank * shard:(rank + 1) * shard].clone().requires_grad_(True)
    loss = plan.fused_loss_sum(h, w_local, labels)
    loss.backward()
    return loss.detach(), h.grad, w_local.grad


def test_fused_loss_sum_vocab_parallel():
    ref = _reference()
    out = run_ranks(_tp_rank, 2)
    for loss, dh, _ in out:
        assert rel_err(loss, ref[0], "rms") <= 1e-5 and rel_err(dh, ref[1], "rms") <= 1e-5
    assert rel_err(torch.cat([o[2] for o in out]), ref[2], "rms") <= 1e-5
