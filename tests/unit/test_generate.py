"""KV-cache decoding against full recomputation (reference: ``Transformer.forward`` on the whole
sequence). Tolerance 1e-5 in float32 on O(1) logits: cached and full forwards compute the same
dot products with different matmul shapes, so they differ only by float32 summation order."""
from __future__ import annotations

import pytest
import torch

from ndtrain.inference.generate import KVCache, generate, sample_next
from ndtrain.model import build_model
from tests.utils import tiny_config


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config({"model.vocab_size": 64, "model.max_seq_len": 32, "model.rope_theta": 500000.0,
                       "model.init_std": 0.3, "model.rope_scaling": True,
                       "model.rope_original_max_seq_len": 16}).model
    return build_model(cfg, seed=0).eval()


def seq(n, seed=0):
    return torch.randint(0, 64, (2, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_cached_logits_equal_full_forward(model):
    x = seq(12)
    full = model(x)  # (B, T, V)
    assert full.abs().max() > 1.0
    cache = KVCache(batch_size=2, max_seq_len=32)
    got = [model(x[:, :3], kv_cache=cache)]  # prefill (no offset)
    got.append(model(x[:, 3:7], kv_cache=cache))  # chunk with offset: masked path
    for t in range(7, 12):  # single-token decode
        got.append(model(x[:, t:t + 1], kv_cache=cache))
    assert cache.length == 12
    torch.testing.assert_close(torch.cat(got, dim=1), full, atol=1e-5, rtol=0)


@torch.no_grad()
def test_cache_overflow_and_batch_errors(model):
    cache = KVCache(batch_size=2, max_seq_len=8)
    model(seq(6), kv_cache=cache)
    with pytest.raises(ValueError, match="overflow"):
        model(seq(3), kv_cache=cache)
    with pytest.raises(ValueError, match="batch"):
        model(seq(1)[:1], kv_cache=KVCache(batch_size=2, max_seq_len=8))


def test_greedy_cache_equals_recompute(model):
    prompt = seq(5)[0]
    a = generate(model, prompt, max_new_tokens=10)
    b = generate(model, prompt, max_new_tokens=10, use_cache=False)
    assert a.shape == (15,) and torch.equal(a[:5], prompt)
    assert torch.equal(a, b)


def test_sampling_reproducible_and_top1_is_greedy(model):
    prompt = seq(4)[1]
    s1 = generate(model, prompt, 8, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(1))
    s2 = generate(model, prompt, 8, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(1))
    assert torch.equal(s1, s2)
    greedy = generate(model, prompt, 8)
    top1 = generate(model, prompt, 8, temperature=0.7, top_k=1, generator=torch.Generator().manual_seed(2))
    assert torch.equal(greedy, top1)
    assert model.training is False


def test_sample_next_topk_support():
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0]])
    g = torch.Generator().manual_seed(0)
    draws = {sample_next(logits, 2.0, top_k=2, generator=g).item() for _ in range(50)}
    assert draws == {1, 2}
    with pytest.raises(ValueError):
        sample_next(logits, -1.0)


def test_generate_length_error(model):
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(model, seq(30)[0], max_new_tokens=5)
