"""MLA (DeepSeek-V2): latent KV cache size and cached decoding; MTP (DeepSeek-V3): shifts, losses
and their weight in the training gradient."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ndtrain.config import Config, DataConfig, ModelConfig, TrainingConfig
from ndtrain.inference.generate import KVCache
from ndtrain.mesh import ParallelDims
from ndtrain.model import build_model
from ndtrain.model.mla import MLAttention
from ndtrain.train.loop import Trainer
from tests.utils import tiny_config

MLA = dict(attention="mla", mla_q_rank=16, mla_kv_rank=12, mla_rope_dim=4, mla_nope_dim=8, mla_v_dim=6)


def tiny(**kw) -> ModelConfig:
    return tiny_config({"model.vocab_size": 64, "model.max_seq_len": 32, "model.rope_theta": 500000.0,
                        "model.n_kv_heads": 4, "model.init_std": 0.2}, model=kw).model


def cache_bytes_per_token(model, cfg: ModelConfig, dtype: torch.dtype) -> float:
    """Fill a KVCache with a 10-token prompt; bytes of all its buffers per cached position."""
    cache = KVCache(1, cfg.max_seq_len)
    model.eval()
    with torch.no_grad():
        model(torch.arange(10).view(1, 10), kv_cache=cache)
    total = sum(t.numel() * t.element_size() for t in [*cache.k.values(), *cache.v.values()])
    return total / cfg.max_seq_len


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_kv_cache_bytes_per_token(dtype):
    """MLA caches (kv_rank + rope_dim) values per token per layer; MHA caches 2 * H * D."""
    mla_cfg, mha_cfg = tiny(**MLA), tiny()
    b = torch.empty((), dtype=dtype).element_size()
    mla = cache_bytes_per_token(build_model(mla_cfg, dtype=dtype), mla_cfg, dtype)
    mha = cache_bytes_per_token(build_model(mha_cfg, dtype=dtype), mha_cfg, dtype)
    assert mla == (12 + 4) * 2 * b  # (latent + rope) x layers x bytes
    assert mha == 2 * 4 * 8 * 2 * b  # (k + v) x heads x head_dim x layers x bytes
    print(f"KV cache bytes/token ({dtype}): MLA {mla:.0f} vs MHA {mha:.0f} ({mha / mla:.1f}x)")


@pytest.mark.parametrize("q_rank", [16, 0])
def test_mla_cached_decoding_matches_full_forward(q_rank):
    """Reference: the uncached forward over the whole sequence. float64; the cached path re-expands
    keys / values from the cached latents, so only summation order differs: 1e-12."""
    cfg = tiny(**{**MLA, "mla_q_rank": q_rank})
    model = build_model(cfg, dtype=torch.float64, seed=1).eval()
    x = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    full = model(x)
    cache = KVCache(2, cfg.max_seq_len)
    parts = [model(x[:, :5], kv_cache=cache)] + [model(x[:, t:t + 1], kv_cache=cache) for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-12, rtol=0)
    assert isinstance(model.layers["0"].attention, MLAttention)
    assert next(iter(cache.k.values())).shape == (2, 1, cfg.max_seq_len, 12)


def test_mla_is_causal_and_position_dependent():
    cfg = tiny(**MLA)
    model = build_model(cfg, dtype=torch.float64, seed=2).eval()
    x = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(1))
    y = x.clone()
    y[0, 6] = (x[0, 6] + 1) % 64
    a, b = model(x), model(y)
    assert torch.equal(a[:, :6], b[:, :6]) and (a[:, 6:] - b[:, 6:]).abs().max() > 1e-6
    # RoPE on the decoupled slice is relative: a uniform shift of positions changes nothing (up to
    # the float32 RoPE tables), stretching them changes the logits
    torch.testing.assert_close(model(x, positions=torch.arange(3, 13)), a, atol=1e-5, rtol=0)
    assert (model(x, positions=2 * torch.arange(10)) - a).abs().max() > 1e-3


def test_mtp_depth_k_sees_token_i_plus_k():
    """Depth k at position i combines h_i with Emb(t_{i+k}): changing token j changes depth-k
    logits at positions >= j - k only (and main logits at >= j)."""
    cfg = tiny(mtp_depth=2)
    model = build_model(cfg, dtype=torch.float64, seed=3)
    x = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(2))
    y = x.clone()
    y[0, 8] = (x[0, 8] + 1) % 64
    model(x)
    a = [t.detach() for t in model.mtp_logits]
    model(y)
    b = [t.detach() for t in model.mtp_logits]
    for k in (1, 2):
        assert a[k - 1].shape == (1, 12 - k, 64)
        diff = (a[k - 1] - b[k - 1]).abs().amax(-1)[0]  # (T-k,)
        assert diff[:8 - k].max() == 0 and diff[8 - k] > 0
    model.eval()
    model(x)
    assert model.mtp_logits == []  # not computed at inference


def _grads(cfg: Config, x: torch.Tensor, y: torch.Tensor) -> tuple[dict, dict]:
    tr = Trainer(cfg, ParallelDims(world_size=1).build_mesh(), torch.device("cpu"))
    grads = {}
    tr.optimizer.step = lambda: grads.update({n: p.grad.clone() for n, p in tr.model.named_parameters()})
    out = tr.step(x, y)
    return grads, out


def test_mtp_losses_present_and_weighted():
    """Trainer gradient = grad of CE_main + lambda / D * sum_k CE_k (token means), checked against a
    hand-written loss on a copy of the model (float64, 1e-12); logged mtp_loss_k equal the direct
    cross-entropies; with lambda = 0 the trunk's gradients equal the model without MTP modules."""
    x = torch.randint(0, 64, (4, 10), generator=torch.Generator().manual_seed(3))
    y = torch.roll(x, -1, 1)
    y[0, :3] = -100  # some ignored labels: per-depth valid counts differ

    def config(depth, weight):
        return Config(model=tiny(mtp_depth=depth, mtp_loss_weight=weight), data=DataConfig(seq_len=10),
                      training=TrainingConfig(dtype="float64", global_batch_size=4, micro_batch_size=2,
                                              grad_clip=0.0, weight_decay=0.0))

    grads, out = _grads(config(2, 0.3), x, y)
    ref = build_model(config(2, 0.3).model, dtype=torch.float64, seed=0)
    logits = ref(x)
    main = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
    mtp = [F.cross_entropy(lg.flatten(0, 1), y[:, k:].flatten(), ignore_index=-100)
           for k, lg in enumerate(ref.mtp_logits, start=1)]
    (main + 0.3 / 2 * sum(mtp)).backward()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-12, rtol=0, msg=n)
    assert grads["mtp.1.proj.weight"].abs().max() > 0
    assert out["loss"] == pytest.approx(main.item(), rel=1e-12)
    for k in (1, 2):
        assert out[f"mtp_loss_{k}"] == pytest.approx(mtp[k - 1].item(), rel=1e-12)
    g0, _ = _grads(config(2, 0.0), x, y)
    g_dense, _ = _grads(config(0, 0.3), x, y)
    for n, g in g_dense.items():
        torch.testing.assert_close(g0[n], g, atol=1e-14, rtol=0, msg=n)
    assert g0["mtp.0.proj.weight"].abs().max() == 0
