"""``training.kernels``: the config rules, and training with Triton kernels equals eager training.

Reference: the same run with ``kernels=eager``, both under full activation checkpointing (so the
Triton autograd Functions are also recomputed). Tolerance 1e-5 relative on every logged loss over 2
steps in fp32 (the kernels differ from eager only in summation order, ~1e-7 per op; the `debug`
preset's tiny model: 2 layers, dim 64, GQA 4:2, head dim 16, 2 x 16 tokens a step).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.ops.kernel_utils import DEVICE

pytest.importorskip("triton")

from ndtrain.config import ConfigError, load_config
from ndtrain.data import prepare_data
from ndtrain.model import build_model
from ndtrain.model.kernels import apply_kernels, resolve_kernels
from ndtrain.ops.flash_attention.triton import FlashAttentionFunction
from ndtrain.ops.rmsnorm.triton import RMSNormFunction
from ndtrain.ops.swiglu.triton import SwiGLUFunction
from ndtrain.train.loop import run
from ndtrain.train.metrics import hfu_factor, read_metrics


def _cfg(tmp_path: Path, **over):
    corpus = tmp_path / "corpus.txt"
    src = Path(__file__).resolve().parents[2] / "ndtrain" / "model"
    corpus.write_text("\n".join(p.read_text() for p in sorted(src.glob("*.py")))[:30000])
    base = {"data.source": str(corpus), "data.tokenizer": "bytes", "data.cache_dir": str(tmp_path / "cache"),
            "training.steps": 2, "training.global_batch_size": 2, "training.micro_batch_size": 2,
            "logging.log_every": 1, "training.eval_batches": 1, "checkpoint.every": 0,
            "training.sample_tokens": 0, "training.device": "cpu", "data.seq_len": 16}
    base.update(over)
    return load_config("debug", base, world_size=1)


def test_rules(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="eager|triton|auto"):
        _cfg(tmp_path, **{"training.kernels": "cuda"})
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="needs a CUDA device, or TRITON_INTERPRET=1"):
        _cfg(tmp_path, **{"training.kernels": "triton"})
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ConfigError, match="no float64 kernels"):
        _cfg(tmp_path, **{"training.kernels": "triton", "training.dtype": "float64"})
    assert _cfg(tmp_path, **{"training.kernels": "triton"}).training.kernels == "triton"
    assert resolve_kernels("auto", cuda=False) == "eager" and resolve_kernels("auto", cuda=True) == "triton"


def test_apply_kernels_swaps_every_op(tmp_path):
    model = build_model(_cfg(tmp_path).model, "cpu")
    assert apply_kernels(model, "eager") == {"rmsnorm": 0, "swiglu": 0, "attention": 0}
    assert apply_kernels(model, "auto") == {"rmsnorm": 0, "swiglu": 0, "attention": 0}  # a CPU model
    assert apply_kernels(model, "triton") == {"rmsnorm": 5, "swiglu": 2, "attention": 2}  # 2 per block + final


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreted run is the CPU check")
def test_training_with_triton_kernels_equals_eager(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    calls = {}
    for fn in (RMSNormFunction, SwiGLUFunction, FlashAttentionFunction):  # count the kernels' launches
        def counted(*args, _apply=fn.apply, _name=fn.__name__):
            calls[_name] = calls.get(_name, 0) + 1
            return _apply(*args)
        monkeypatch.setattr(fn, "apply", counted)
    losses = {}
    for kind in ("eager", "triton"):
        cfg = _cfg(tmp_path, **{"training.kernels": kind, "training.activation_checkpoint": "full"})
        run(cfg, tmp_path / kind, prepare_data(cfg.data, cfg.model.vocab_size))
        rows = read_metrics(tmp_path / kind)
        losses[kind] = [(r["step"], r.get("loss"), r.get("val_loss")) for r in rows]
        factor = hfu_factor(cfg.model, cfg.data.seq_len, "full")
        for r in rows:  # every training row carries HFU = MFU x (1 + recompute / model FLOPs)
            if "loss" in r:
                assert r["hfu"] == pytest.approx(r["mfu"] * factor) and factor > 1.1
        if kind == "eager":
            assert calls == {}
    assert calls["RMSNormFunction"] >= 5 * 2 and calls["SwiGLUFunction"] >= 2 * 2  # the Triton run used them
    assert calls["FlashAttentionFunction"] >= 2 * 2
    assert len(losses["eager"]) == 3  # step-0 validation + 2 training steps
    for (s1, l1, v1), (s2, l2, v2) in zip(losses["eager"], losses["triton"]):
        assert s1 == s2
        for a, b in ((l1, l2), (v1, v2)):
            assert (a is None) == (b is None)
            if a is not None:
                assert b == pytest.approx(a, rel=1e-5)
