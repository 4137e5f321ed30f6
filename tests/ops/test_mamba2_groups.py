"""Mamba-2 with several B / C groups (``model.mamba_groups``, HF ``n_groups``): the chunked form
equals the naive recurrence on logits and every parameter gradient (float64) in a mixer-only
(``block_ffn: false``) model. That the grouping is HF's (head h reads group h // (n_h / g), the
gated norm per group) is pinned by tests/integration/test_hf_mamba2.py.

Reference: the naive per-token recurrence (``LINEAR_IMPL["impl"] = "naive"``). Tolerances: logits
1e-10 and gradients 1e-8 relative RMS in float64 - the chunked form only regroups the same sums
(chunk-local decays, inter-chunk state products), ~1e-14 in float64; the gradients pass through
exp / softplus of the decays over 11 tokens, which amplifies that roundoff by a few orders, while a
wrong group for a head or a norm over the whole width moves them by O(1)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ndtrain.config import ModelConfig
from ndtrain.model import build_model, mixers
from tests.utils import rel_err


def test_grouped_mamba2_chunk_equals_naive_with_all_gradients():
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=64, layer_pattern="M",
                      block_ffn=False, linear_chunk_size=4, mamba_state_dim=8, mamba_head_dim=8, mamba_groups=4)
    model = build_model(cfg, dtype=torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    tokens = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(0))
    results = []
    for impl in ("chunk", "naive"):
        mixers.LINEAR_IMPL["impl"] = impl
        try:
            model.zero_grad()
            logits = model(tokens)
            F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
        finally:
            mixers.LINEAR_IMPL["impl"] = "chunk"
        results.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (la, ga), (lb, gb) = results
    assert rel_err(la, lb, "rms") <= 1e-10
    assert "layers.0.attention.in_proj.weight" in ga and not any("feed_forward" in n for n in ga)
    for n in ga:
        assert rel_err(ga[n], gb[n], "rms") <= 1e-8, n
