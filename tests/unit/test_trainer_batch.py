"""A short local batch is trained on exactly.

Reference: the same 3 sequences as one microbatch. With ``micro_batch_size=2`` the trainer runs a
microbatch of 2 and one of 1; the token-weighted loss makes that exact, so loss and every gradient
equal the reference to float64 rounding (1e-12 relative). The bug this pins dropped the third
sequence but divided by its tokens: the loss was off by about a third.
"""
from __future__ import annotations

import torch

from ndtrain.mesh import ParallelDims
from ndtrain.train.loop import IGNORE_INDEX, Trainer
from tests.utils import tiny_config

V, T = 64, 8


def _trainer(micro: int) -> Trainer:
    cfg = tiny_config({"model.vocab_size": V, "model.max_seq_len": 16, "data.seq_len": T,
                       "training.micro_batch_size": micro, "training.steps": 100, "training.lr": 3e-4,
                       "training.warmup_steps": 10, "training.grad_clip": 0.0,
                       "parallel.bucket_size_bytes": 25 * 2**20, "parallel.dp_shard": 1})
    return Trainer(cfg, ParallelDims(world_size=1).build_mesh(), torch.device("cpu"))


def _step(tr: Trainer, inputs, labels):
    grads = {}
    tr.optimizer.step = lambda: grads.update({n: p.grad.clone() for n, p in tr.model.named_parameters()})
    return tr.step(inputs, labels), grads


def test_short_batch_with_partial_microbatch_equals_full_batch():
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, V, (3, T), generator=g)
    labels = torch.randint(0, V, (3, T), generator=g)
    labels[2, :3] = IGNORE_INDEX  # uneven valid tokens per sequence
    ref, ref_grads = _step(_trainer(0), inputs, labels)
    out, grads = _step(_trainer(2), inputs, labels)
    assert out["n_tokens"] == ref["n_tokens"] == 3 * T - 3
    assert abs(out["loss"] - ref["loss"]) <= 1e-12 * ref["loss"]
    assert grads.keys() == ref_grads.keys() and len(grads) > 0
    for name, g_ref in ref_grads.items():
        torch.testing.assert_close(grads[name], g_ref, rtol=1e-12, atol=1e-15, msg=name)
