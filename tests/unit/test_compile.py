"""``training.compile`` (torch.compile per block) and ``training.fp8`` (its rules on a CPU).

Reference: the same ``Trainer`` run eagerly, single process, same seed and batches. Compared: the
loss and gradient norm of each of 10 steps and the eval loss, at 1e-5 relative in float32
(Inductor fuses and reorders the block's arithmetic, measured ~5e-8 here). Compiled under
activation checkpointing (whose hooks stay outside the compiled forward), the parameter names
must stay those of the eager model. The 2-rank check runs ZeRO-3 over dp 2 and tp 2 in one spawn
against the single-process eager oracle. Both are ``slow``: Inductor's cold compile of a block
takes a minute or more per process on this 2-core CPU (C++ codegen and gcc).
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from ndtrain.config import ConfigError
from ndtrain.mesh import ParallelDims
from ndtrain.parallel import compile as compile_mod
from tests.dist_utils import run_ranks
from tests.ops.test_kernels_training import B, assert_close, tiny_cfg, train


def _f32(**over):
    return {"training.dtype": "float32", "training.activation_checkpoint": "selective", **over}


@pytest.mark.slow  # Inductor's first compile: 82 s on this 2-core machine under load 17 (2026-12-01)
def test_compiled_blocks_equal_eager():
    torch.set_num_threads(1)
    ref = train(tiny_cfg(**_f32()))
    got = train(tiny_cfg(**_f32(**{"training.compile": True})))
    assert_close(got[:2], ref[:2], 1e-5)
    model = got[2].model
    assert all(hasattr(b.forward, "_torchdynamo_orig_callable") for b in model.layers.values())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref[2].model.named_parameters()]


LAYOUTS = {
    "zero3_dp2": {"parallel.zero_stage": 3, "parallel.dp_shard": 2},
    "tp2": {"parallel.tp": 2, "parallel.dp_shard": 1},
}


def _layouts_rank(rank: int, world: int):
    torch.set_num_threads(1)
    out = {}
    for name, over in LAYOUTS.items():
        cfg = tiny_cfg(world, **_f32(**{"training.compile": True, **over}))
        mesh = ParallelDims.from_config(cfg.parallel, world).build_mesh()
        dp = mesh.dims.dp
        rows = slice(rank * B // dp, (rank + 1) * B // dp) if dp > 1 else slice(None)
        out[name] = train(cfg, mesh, rows)[:2]
    return out


@pytest.mark.slow
def test_compiled_layouts_equal_eager_single_process():
    ref = train(tiny_cfg(**_f32()))[:2]
    for rank_out in run_ranks(_layouts_rank, 2, timeout_s=600.0):
        for name in LAYOUTS:
            assert_close(rank_out[name], ref, 1e-5)


def test_fp8_rejected_before_launch(monkeypatch):
    """On this machine fp8 is refused by validation (no process starts), naming the rule: torchao
    missing, or no CUDA GPU, or one older than sm89."""
    with pytest.raises(ConfigError, match="training.fp8=true needs"):
        tiny_cfg(**{"training.fp8": True, "training.dtype": "bfloat16"})
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "torchao" else real(n, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        tiny_cfg(**{"training.fp8": True, "training.dtype": "bfloat16"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100")
    with pytest.raises(ConfigError, match=r"compute capability >= 8.9.*A100 is 8.0"):
        tiny_cfg(**{"training.fp8": True, "training.dtype": "bfloat16", "training.device": "cuda"})
    with pytest.raises(ConfigError, match="needs training.dtype bfloat16 or float32"):
        tiny_cfg(**{"training.fp8": True})  # float64
    assert compile_mod.fp8_filter(torch.nn.Linear(32, 48), "layers.0.attention.wq")
    assert not compile_mod.fp8_filter(torch.nn.Linear(32, 61), "output")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or compile_mod.fp8_support(), reason="needs sm89+ and torchao")
def test_fp8_training_close_to_bf16():
    """fp8 linears on an sm89+ GPU: 10 steps of a dim-256 model stay within 5% of bf16's losses
    (e4m3 has a 3-bit mantissa: equality is not expected, divergence would be a bug)."""
    over = {"model.dim": 256, "model.n_heads": 8, "model.ffn_hidden": 512, "training.dtype": "bfloat16",
            "training.device": "cuda", "model.vocab_size": 256}
    ref = tiny_cfg(**over)
    got = tiny_cfg(**over, **{"training.fp8": True})
    from ndtrain.train.trainer import Trainer

    losses = []
    for cfg in (ref, got):
        torch.manual_seed(0)
        tr = Trainer(cfg, ParallelDims().build_mesh(), torch.device("cuda"))
        g = torch.Generator().manual_seed(0)
        row = []
        for _ in range(10):
            seq = torch.randint(0, 256, (4, 17), generator=g)
            row.append(tr.step(seq[:, :-1], seq[:, 1:])["loss"])
        losses.append(row)
    assert "Float8Linear" in repr(tr.model)
    assert all(abs(a - b) / b < 0.05 for a, b in zip(*losses))
