"""HFU: the recompute FLOPs of each activation-checkpointing policy, measured.

Reference: ``torch.utils.flop_counter.FlopCounterMode`` over one forward + backward of a tiny model
with the policy applied by ``ndtrain.parallel.activation_ckpt``; the counter sees every matmul that
really runs, including torch's early-stopped recompute, and (with the mapping below) the CPU SDPA
kernel. The extra FLOPs over ``none`` must equal ``recompute_flops_per_token * tokens``. Tolerance
0.5%: the formula counts the norm gains at 2 FLOPs per parameter (PaLM's 6N convention), which the
counter does not see (0.3% of a block here).
"""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from ndtrain.config import ModelConfig
from ndtrain.model import build_model
from ndtrain.parallel.activation_ckpt import apply_activation_checkpoint
from ndtrain.train.metrics import flops_per_token, format_line, hfu_factor, recompute_flops_per_token

_SDPA = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_SDPA_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _sdpa_fwd(q, k, v, *args, out_shape=None, **kw):  # the counter passes shapes, not tensors
    return sdpa_flop_count(q, k, v)


def _sdpa_bwd(dout, q, k, v, *args, out_shape=None, **kw):
    return sdpa_backward_flop_count(dout, q, k, v)


def _measured(cfg: ModelConfig, policy: str, b: int, t: int) -> int:
    model = build_model(cfg, "cpu", torch.float32, seed=0)
    apply_activation_checkpoint(model, policy)
    x = torch.randint(0, cfg.vocab_size, (b, t))
    mapping = {_SDPA: _sdpa_fwd, _SDPA_BWD: _sdpa_bwd}  # CPU SDPA has no built-in formula
    with FlopCounterMode(display=False, custom_mapping=mapping) as fc:
        model(x).sum().backward()
    return fc.get_total_flops()


CFG = ModelConfig(vocab_size=128, dim=64, n_layers=5, n_heads=4, ffn_hidden=128, max_seq_len=64)


@pytest.mark.parametrize("policy", ["full", "every:2", "every:3", "every:5", "sqrt", "selective"])
def test_recompute_flops_match_the_counter(policy):
    b, t = 2, 16
    base = _measured(CFG, "none", b, t)
    extra = _measured(CFG, policy, b, t) - base
    want = recompute_flops_per_token(CFG, t, policy) * b * t
    assert extra > 0
    assert extra == pytest.approx(want, rel=5e-3), (policy, extra, want)


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_hybrid_layers_recompute(policy):
    """Attention + linear-attention layers (``layer_pattern="AL"``): selective adds only the two
    softmax cores (exact); full recompute is within 3%, because a linear mixer's FLOPs follow the
    model-FLOPs convention of ``ndtrain.mixer_spec`` rather than its chunked kernel's exact count."""
    cfg = ModelConfig(vocab_size=128, dim=64, n_layers=4, n_heads=4, ffn_hidden=128, max_seq_len=64,
                      layer_pattern="AL")
    extra = _measured(cfg, policy, 2, 16) - _measured(cfg, "none", 2, 16)
    want = recompute_flops_per_token(cfg, 16, policy) * 32
    assert extra == pytest.approx(want, rel=3e-2 if policy == "full" else 1e-9)


def test_hfu_factor_values():
    """none = 1; full < every:C (two levels replay more) ; selective adds only the attention core."""
    t = 16
    assert hfu_factor(CFG, t, "none") == 1.0
    full, ev5, sel = (hfu_factor(CFG, t, p) for p in ("full", "every:5", "selective"))
    assert 1.0 < sel < full < ev5 < 4 / 3 + 1 / 3  # at most two extra forwards of a third each
    core = 2 * CFG.n_heads * 2 * CFG.head_dim * t * CFG.n_layers  # QK^T + AV forward, all layers
    assert sel == pytest.approx(1 + core / flops_per_token(CFG, t))


def test_log_line_shows_hfu():
    line = format_line({"step": 3, "loss": 1.0, "mfu": 0.2, "hfu": 0.25})
    assert "mfu 20.0%" in line and "hfu 25.0%" in line
