"""Single-device model: shapes, GQA, init determinism, tying, RoPE scaling, pipeline stages, causality."""
from __future__ import annotations

import math

import pytest
import torch

from ndtrain.config import ModelConfig
from ndtrain.model import Transformer, build_model, count_params, rope_inv_freq
from tests.utils import tiny_config


def tiny(**kw) -> ModelConfig:
    return tiny_config({"model.vocab_size": 64, "model.max_seq_len": 32, "model.rope_theta": 500000.0},
                       model=kw).model


def tokens(b=2, t=8, v=64, seed=0):
    return torch.randint(0, v, (b, t), generator=torch.Generator().manual_seed(seed))


def test_shapes_and_param_count():
    cfg = tiny()
    m = build_model(cfg, seed=0)
    assert m(tokens()).shape == (2, 8, cfg.vocab_size)
    c, f, d, g = cfg.dim, cfg.ffn_dim, cfg.head_dim, cfg.kv_heads
    block = 2 * c * c + 2 * c * g * d + 3 * c * f + 2 * c
    emb = cfg.vocab_size * c
    assert count_params(m) == 2 * emb + cfg.n_layers * block + c
    assert count_params(m, include_embedding=False) == emb + cfg.n_layers * block + c
    assert m.layers["0"].attention.wq.weight.shape == (cfg.n_heads * d, c)
    assert m.layers["0"].attention.wk.weight.shape == (g * d, c)


def test_gqa_equals_mha_with_repeated_kv_weights():
    gqa_cfg = tiny(init_std=0.3)
    mha_cfg = tiny(n_kv_heads=0)
    gqa, mha = build_model(gqa_cfg, seed=1), build_model(mha_cfg, seed=2)
    rep = gqa_cfg.n_heads // gqa_cfg.kv_heads
    sd = {}
    for k, v in gqa.state_dict().items():
        if k.endswith(("wk.weight", "wv.weight")):  # (G*D, C) -> (H*D, C), kv head g serves heads g*rep..
            v = v.view(gqa_cfg.kv_heads, gqa_cfg.head_dim, -1).repeat_interleave(rep, dim=0).reshape(-1, v.shape[-1])
        sd[k] = v
    mha.load_state_dict(sd)
    x = tokens()
    torch.testing.assert_close(gqa(x), mha(x), atol=1e-5, rtol=0)


def test_init_same_values_for_float32_and_float64():
    cfg = tiny()
    p32 = dict(build_model(cfg, dtype=torch.float32, seed=7).named_parameters())
    p64 = dict(build_model(cfg, dtype=torch.float64, seed=7).named_parameters())
    assert p32.keys() == p64.keys()
    for k in p32:
        assert p64[k].dtype == torch.float64
        assert torch.equal(p64[k].float(), p32[k]), k


def test_init_independent_of_other_layers_and_seeded():
    cfg = tiny(n_layers=3)
    full = build_model(cfg, seed=3)
    with torch.device("meta"):
        stage = Transformer(cfg)
    del stage.layers["0"]
    stage.tok_embeddings = None
    stage.to_empty(device="cpu")
    stage.init_weights(3)
    assert list(stage.layers.keys()) == ["1", "2"]
    for k, v in stage.state_dict().items():
        assert torch.equal(v, full.state_dict()[k]), k
    other = build_model(cfg, seed=4)
    assert not torch.equal(other.layers["1"].attention.wq.weight, full.layers["1"].attention.wq.weight)
    assert not torch.equal(full.layers["1"].attention.wq.weight, full.layers["2"].attention.wq.weight)


def test_init_statistics():
    cfg = tiny(dim=128, n_heads=4, n_layers=8, init_std=0.05)
    m = build_model(cfg, seed=0)
    blk = m.layers["3"]
    assert torch.equal(blk.ffn_norm.weight, torch.ones(cfg.dim))
    assert abs(blk.attention.wq.weight.std().item() / 0.05 - 1) < 0.05
    scaled = 0.05 / math.sqrt(2 * cfg.n_layers)
    assert abs(blk.attention.wo.weight.std().item() / scaled - 1) < 0.05
    assert abs(blk.feed_forward.w2.weight.std().item() / scaled - 1) < 0.05


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_init_same_values_on_cpu_and_cuda():
    cfg = tiny()
    cpu, gpu = build_model(cfg, "cpu", seed=5), build_model(cfg, "cuda", seed=5)
    for (k, a), (_, b) in zip(cpu.named_parameters(), gpu.named_parameters()):
        assert torch.equal(a, b.cpu()), k


def test_tied_embeddings():
    m = build_model(tiny(tie_embeddings=True), seed=0)
    assert m.output.weight is m.tok_embeddings.weight
    assert count_params(m) == count_params(build_model(tiny(), seed=0)) - 64 * 32
    m(tokens()).sum().backward()
    assert m.tok_embeddings.weight.grad is not None


def test_rope_llama31_scaling_only_below_threshold():
    cfg = tiny(dim=64, n_heads=2, rope_theta=500000.0)  # head_dim 32: wavelengths 6.3 .. ~2e6
    scaled_cfg = tiny(dim=64, n_heads=2, rope_theta=500000.0, rope_scaling=True, rope_scaling_factor=8.0,
                      rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_seq_len=64)
    base, scaled = rope_inv_freq(cfg), rope_inv_freq(scaled_cfg)
    wavelen = 2 * math.pi / base
    high = wavelen < 64 / 4.0  # short wavelengths (high frequencies): unchanged
    low = wavelen > 64 / 1.0  # long wavelengths (low frequencies): divided by the factor
    mid = ~high & ~low
    assert high.any() and low.any() and mid.any()
    assert torch.equal(scaled[high], base[high])
    torch.testing.assert_close(scaled[low], base[low] / 8.0)
    assert ((scaled[mid] < base[mid]) & (scaled[mid] > base[mid] / 8.0)).all()
    smooth = (64 / wavelen[mid] - 1.0) / (4.0 - 1.0)  # Llama 3.1 linear interpolation in L / wavelength
    torch.testing.assert_close(scaled[mid], (1 - smooth) * base[mid] / 8.0 + smooth * base[mid])


def test_pipeline_stages_compose():
    cfg = tiny()
    full = build_model(cfg, seed=0)
    with torch.device("meta"):
        first, last = Transformer(cfg), Transformer(cfg)
    del first.layers["1"]
    first.norm, first.output = None, None
    del last.layers["0"]
    last.tok_embeddings = None
    for s in (first, last):
        s.to_empty(device="cpu")
        s.init_weights(0)
    x = tokens()
    h = first(x)
    assert h.shape == (2, 8, cfg.dim)
    torch.testing.assert_close(last(h), full(x), atol=0, rtol=0)


def test_causal():
    m = build_model(tiny(), seed=0)
    x = tokens()
    y = x.clone()
    y[:, 5] = (y[:, 5] + 1) % 64
    a, b = m(x), m(y)
    torch.testing.assert_close(a[:, :5], b[:, :5], atol=0, rtol=0)
    assert not torch.allclose(a[:, 5:], b[:, 5:])


def test_positions_relative_and_batched():
    """RoPE scores depend only on position differences: shifting every position leaves logits equal.

    Tolerance 1e-4 on O(1) logits: the fp32 tables round angles ``pos * inv_freq`` (~1e-6 rad).
    """
    m = build_model(tiny(init_std=0.3), seed=0)
    x = tokens()
    ref = m(x)
    assert ref.abs().max() > 1.0
    torch.testing.assert_close(m(x, positions=torch.arange(8) + 11), ref, atol=1e-4, rtol=0)
    pos = torch.stack([torch.arange(8), torch.arange(8) + 5])  # (B, T)
    torch.testing.assert_close(m(x, positions=pos), ref, atol=1e-4, rtol=0)
    assert not torch.allclose(m(x, positions=torch.arange(8) * 2), ref)


def test_attention_core_is_overridable():
    m = build_model(tiny(), seed=0)
    x = tokens()
    ref = m(x)
    calls = []
    for blk in m.layers.values():
        orig = blk.attention.core

        def core(q, k, v, orig=orig):
            calls.append((q.shape, k.shape))
            return orig(q, k, v)
        blk.attention.core = core
    torch.testing.assert_close(m(x), ref, atol=0, rtol=0)
    assert calls[0] == ((2, 4, 8, 8), (2, 2, 8, 8))  # (B, H, T, D), (B, G, T, D)
