"""``training.fused_loss``: training with the loss fused into the output head equals the unfused run.

Reference: the same ``Trainer`` with ``fused_loss=false`` (logits materialised, ``F.cross_entropy``
or the vocab-parallel loss), single process, same seed and batches. Compared: the loss and the
gradient norm of each of 10 steps (each step's loss depends on every earlier update, so a wrong
gradient anywhere shows up) and the eval loss. Tolerance: 1e-10 relative in float64 (only the
summation order of the log-sum-exp differs), 1e-5 in float32. The 2-rank check runs every layout
that touches the head in ONE spawn: tp 2, tp 2 + sequence parallel, cp 2 (ring), pp 2 with tied
embeddings (the pipeline's last stage arms the head), ZeRO-3 over dp 2 (the head's unit is
gathered around the fused loss), each compared with the single-process unfused oracle.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ndtrain.config import ConfigError
from ndtrain.mesh import ParallelDims
from ndtrain.ops.linear_cross_entropy.chunk import (
    ChunkedLinearCrossEntropyFunction,
    chunk_linear_cross_entropy,
)
from ndtrain.parallel.fused_head import FusedLossHead
from ndtrain.train.trainer import Trainer
from tests.dist_utils import run_ranks
from tests.utils import tiny_config

STEPS, B, T, V = 10, 4, 16, 61  # V odd: tp pads the vocabulary


def tiny_cfg(world: int = 1, **over):
    return tiny_config({"model.vocab_size": V, "data.seq_len": T, "training.global_batch_size": B,
                        "training.device": "cpu", "training.grad_clip": 1.0, **over}, world=world)


def batches():
    g = torch.Generator().manual_seed(7)
    for _ in range(STEPS):
        seq = torch.randint(0, V, (B, T + 1), generator=g)
        labels = seq[:, 1:].clone()
        labels[torch.rand(B, T, generator=g) < 0.2] = -100
        yield seq[:, :-1], labels


def train(cfg, mesh=None, rows: slice = slice(None)) -> tuple[list, float, Trainer]:
    """[(loss, grad_norm)] of STEPS steps on ``rows`` of each global batch, the final eval loss."""
    torch.manual_seed(0)
    tr = Trainer(cfg, mesh or ParallelDims().build_mesh(), torch.device("cpu"))
    out, data = [], list(batches())
    for x, y in data:
        o = tr.step(x[rows], y[rows])
        out.append((o["loss"], o["grad_norm"]))
    return out, tr.eval_loss([(x[rows], y[rows]) for x, y in data[:2]]), tr


def assert_close(got, ref, tol):
    (a, ea), (b, eb) = got, ref
    rel = max(max(abs(x - y) / abs(y) for x, y in zip(p, q)) for p, q in zip(a, b))
    assert rel <= tol and abs(ea - eb) / abs(eb) <= tol, (rel, ea, eb)


def test_chunk_twin_equals_naive():
    """The PyTorch chunked loss against full logits, blocks smaller than N and V (3 x 4 blocks,
    ragged), padded rows and ignored labels; value, dh and dW at 1e-12 in float64."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 8, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(53, 8, dtype=torch.float64, generator=g, requires_grad=True)
    y = torch.randint(0, 50, (37,), generator=g)
    y[3] = -100
    loss = chunk_linear_cross_entropy(h, w, y, chunk_tokens=16, chunk_vocab=16, vocab_size=50)
    dh, dw = torch.autograd.grad(loss.sum() * 1.5, (h, w))
    ref = F.cross_entropy(h @ w[:50].t(), y, reduction="none")  # float64 logits (the naive twin is fp32)
    rh, rw = torch.autograd.grad(ref.sum() * 1.5, (h, w))
    assert torch.allclose(loss, ref, rtol=1e-12, atol=1e-12) and loss[3] == 0
    assert torch.allclose(dh, rh, rtol=1e-12, atol=1e-12) and torch.allclose(dw, rw, rtol=1e-12, atol=1e-12)
    assert torch.equal(dw[50:], torch.zeros(3, 8, dtype=torch.float64))


@pytest.mark.parametrize("dtype,tol", [("float64", 1e-10), ("float32", 1e-5)])
def test_fused_loss_training_equals_unfused(dtype, tol, monkeypatch):
    torch.set_num_threads(1)
    calls = []
    monkeypatch.setattr(ChunkedLinearCrossEntropyFunction, "apply",
                        lambda *a, _f=ChunkedLinearCrossEntropyFunction.apply: calls.append(1) or _f(*a))
    for over in ({}, {"model.tie_embeddings": True, "training.micro_batch_size": 2,
                      "training.activation_checkpoint": "full"}):
        ref = train(tiny_cfg(**{"training.dtype": dtype, **over}))
        assert not calls
        got = train(tiny_cfg(**{"training.dtype": dtype, "training.fused_loss": True, **over}))
        assert isinstance(got[2].model.output, FusedLossHead)
        assert len(calls) == STEPS * (2 if over else 1) + 2  # every microbatch and eval batch fused
        calls.clear()
        assert_close(got[:2], ref[:2], tol)
        if over:  # tied: the head still holds the embedding's Parameter
            assert got[2].model.output.weight is got[2].model.tok_embeddings.weight


def test_fused_loss_rules():
    with pytest.raises(ConfigError, match="fused_loss=true with model.mtp_depth"):
        tiny_cfg(**{"training.fused_loss": True, "model.mtp_depth": 1})


LAYOUTS = {
    "tp2": {"parallel.tp": 2, "parallel.dp_shard": 1},
    "tp2_sp": {"parallel.tp": 2, "parallel.dp_shard": 1, "parallel.sequence_parallel": True},
    "cp2": {"parallel.cp": 2, "parallel.dp_shard": 1},
    "pp2_tied": {"parallel.pp": 2, "parallel.dp_shard": 1, "model.tie_embeddings": True,
                 "training.micro_batch_size": 2},
    "zero3_dp2": {"parallel.zero_stage": 3, "parallel.dp_shard": 2, "parallel.keep_last_unit_gathered": False},
}


def _layouts_rank(rank: int, world: int):
    torch.set_num_threads(1)
    out = {}
    for name, over in LAYOUTS.items():
        cfg = tiny_cfg(world, **{"training.fused_loss": True, **over})
        mesh = ParallelDims.from_config(cfg.parallel, world).build_mesh()
        dp = mesh.dims.dp
        rows = slice(rank * B // dp, (rank + 1) * B // dp) if dp > 1 else slice(None)
        losses, ev, tr = train(cfg, mesh, rows)
        assert mesh.dims.pp > 1 and rank == 0 or isinstance(tr.model.output, FusedLossHead), name
        out[name] = (losses, ev)
    return out


def test_fused_loss_layouts_equal_single_process():
    ref = {}
    for name, over in LAYOUTS.items():
        single = {k: v for k, v in over.items() if not k.startswith("parallel.")}
        ref[name] = train(tiny_cfg(**single))[:2]
    for rank_out in run_ranks(_layouts_rank, 2):
        for name in LAYOUTS:
            assert_close(rank_out[name], ref[name], 1e-10)


@pytest.mark.slow  # Triton's CPU interpreter: 60 s on this 2-core machine under load (2026-12-01)
def test_fused_loss_triton_kernels_equal_unfused(monkeypatch):
    """kernels=triton picks the Triton fused loss (interpreted on a CPU); fp32, 1e-5."""
    pytest.importorskip("triton")
    from ndtrain.ops.linear_cross_entropy import triton as tri

    torch.set_num_threads(1)
    calls = []
    monkeypatch.setattr(tri.LinearCrossEntropyFunction, "apply",
                        lambda *a, _f=tri.LinearCrossEntropyFunction.apply: calls.append(1) or _f(*a))
    over = {"training.dtype": "float32", "training.kernels": "triton"}
    ref = train(tiny_cfg(**over))
    got = train(tiny_cfg(**over, **{"training.fused_loss": True}))
    assert len(calls) == STEPS + 2
    assert_close(got[:2], ref[:2], 1e-5)
