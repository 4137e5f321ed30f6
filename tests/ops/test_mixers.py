"""Token-mixer ops: every fast form against its slow twin, on outputs, final states and every
gradient (q, k, v, decays, beta, initial state).

References: ``naive_*`` (the paper's recurrence, token by token; for the delta rule the explicit
(I - b k k^T) matrix product) and, for the windowed / sparse attentions, full attention under the
equivalent mask. Tolerances (relative RMS): 1e-5 in float64 (the forms differ only in summation
order: observed ~1e-15); 2e-2 for bfloat16 inputs against the float64 reference on the same
rounded inputs (the bf16 output rounding alone is ~4e-3).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ndtrain.config.schema import ModelConfig
from ndtrain.model import build_model, causal_attention, mixers
from ndtrain.model.dsa import dense_topk_attention, select_topk, topk_attention
from ndtrain.model.rope import apply_rope, rope_tables
from ndtrain.model.sliding_window import dense_window_attention, window_attention
from ndtrain.ops.gated_delta import chunk_gated_delta, naive_gated_delta, recurrent_gated_delta_step
from ndtrain.ops.linear_attn import chunk_linear_attn, naive_linear_attn, recurrent_linear_attn_step
from tests.utils import rel_err


def _inputs(t: int, dtype, seed: int = 0, b: int = 2, h: int = 3, dk: int = 8, dv: int = 6):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t, dk, generator=g) * dk ** -0.5
    k = F.normalize(torch.randn(b, h, t, dk, generator=g), dim=-1)  # delta rule needs |k| <= 1
    v = torch.randn(b, h, t, dv, generator=g)
    log_decay = -torch.rand(b, h, t, generator=g) * 0.5
    beta = torch.rand(b, h, t, generator=g)
    s0 = torch.randn(b, h, dk, dv, generator=g) * 0.5
    return [x.to(dtype).requires_grad_() for x in (q, k, v, log_decay, beta, s0)]


def _linear(form, q, k, v, g, beta, s0, c):
    if form == "naive":
        return naive_linear_attn(q, k, v, g, s0)
    if form == "chunk":
        return chunk_linear_attn(q, k, v, g, s0, chunk_size=c)
    state, outs = s0, []
    for i in range(q.shape[2]):
        o, state = recurrent_linear_attn_step(q[:, :, i], k[:, :, i], v[:, :, i], g[:, :, i], state)
        outs.append(o)
    return torch.stack(outs, 2), state


def _delta(form, q, k, v, g, beta, s0, c):
    if form == "naive":
        return naive_gated_delta(q, k, v, g, beta, s0)
    if form == "chunk":
        return chunk_gated_delta(q, k, v, g, beta, s0, chunk_size=c)
    state, outs = s0, []
    for i in range(q.shape[2]):
        o, state = recurrent_gated_delta_step(q[:, :, i], k[:, :, i], v[:, :, i], g[:, :, i], beta[:, :, i], state)
        outs.append(o)
    return torch.stack(outs, 2), state


def _run(op, form, xs, c, weights):
    xs = [x.detach().clone().requires_grad_() for x in xs]
    o, s = op(form, *xs, c)
    ((o * weights[0]).sum() + (s * weights[1]).sum()).backward()
    return o.detach(), s.detach(), [x.grad for x in xs]


@pytest.mark.parametrize("op", [_linear, _delta], ids=["linear_attn", "gated_delta"])
@pytest.mark.parametrize("t,c", [(13, 4), (13, 16), (16, 8), (5, 16), (1, 4)])
def test_chunk_recurrent_naive_agree_float64(op, t, c):
    xs = _inputs(t, torch.float64)
    ref_o, ref_s = op("naive", *xs, c)
    weights = (torch.randn_like(ref_o), torch.randn_like(ref_s))  # a generic cotangent
    ref = _run(op, "naive", xs, c, weights)
    for form in ("chunk", "recurrent"):
        o, s, grads = _run(op, form, xs, c, weights)
        assert rel_err(o, ref[0], "rms") <= 1e-5 and rel_err(s, ref[1], "rms") <= 1e-5, form
        for name, g, rg in zip(("q", "k", "v", "log_decay", "beta", "s0"), grads, ref[2]):
            if op is _linear and name == "beta":
                assert g is None  # linear attention has no beta
                continue
            assert rel_err(g, rg, "rms") <= 1e-5, (form, name)
    # the state carries information: a different initial state changes the output
    o2, _ = op("chunk", *xs[:5], torch.zeros_like(xs[5]), c)
    assert rel_err(o2, ref[0], "rms") > 1e-2


@pytest.mark.parametrize("op", [_linear, _delta], ids=["linear_attn", "gated_delta"])
def test_chunk_bf16_matches_float64_reference(op):
    xs = _inputs(21, torch.bfloat16, seed=1)
    ref_in = [x.detach().double() for x in xs]
    ref_o, ref_s = op("naive", *ref_in, 8)
    weights = (torch.randn_like(ref_o), torch.randn_like(ref_s))
    ref = _run(op, "naive", ref_in, 8, weights)
    o, s, grads = _run(op, "chunk", xs, 8, (weights[0].bfloat16(), weights[1].float()))
    assert o.dtype == torch.bfloat16
    assert rel_err(o, ref[0], "rms") <= 2e-2 and rel_err(s, ref[1], "rms") <= 2e-2
    for g, rg in zip(grads, ref[2]):
        if rg is not None:
            assert rel_err(g, rg, "rms") <= 2e-2


def test_delta_rule_reads_back_what_it_wrote():
    """With a = 1 and b = 1 the delta rule overwrites the value at a unit key: S^T k = v."""
    k = F.normalize(torch.randn(1, 1, 1, 4, dtype=torch.float64), dim=-1)
    v = torch.randn(1, 1, 1, 3, dtype=torch.float64)
    s0 = torch.randn(1, 1, 4, 3, dtype=torch.float64)
    _, s = chunk_gated_delta(k, k, v, torch.zeros(1, 1, 1, dtype=torch.float64),
                             torch.ones(1, 1, 1, dtype=torch.float64), s0)
    assert torch.allclose(torch.einsum("bhkv,bhk->bhv", s, k[:, :, 0]), v[:, :, 0], atol=1e-12)


def _attn_inputs(t, h=4, g=2, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, n, t, d, generator=gen, dtype=torch.float64) for n in (h, g, g))
    return q, k, v


@pytest.mark.parametrize("t,w", [(13, 1), (13, 4), (16, 8), (5, 8), (17, 17)])
def test_window_attention_equals_dense_band(t, w):
    q, k, v = _attn_inputs(t)
    outs, grads = [], []
    for fn in (window_attention, dense_window_attention):
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        o = fn(*xs, w)
        (o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)).sum().backward()
        outs.append(o.detach())
        grads.append([x.grad for x in xs])
    assert rel_err(outs[0], outs[1], "rms") <= 1e-12
    for a, b in zip(*grads):  # absolute floor: with one visible key the q gradient is exactly 0
        assert (a - b).pow(2).mean().sqrt() <= 1e-12 * max(1.0, b.pow(2).mean().sqrt().item())
    if w >= t:  # a window covering the sequence is plain causal attention
        assert rel_err(outs[0], causal_attention(q, k, v), "rms") <= 1e-12
    if w == 1:  # each query sees only itself: output is its own value (GQA: head h uses kv h // 2)
        assert torch.allclose(outs[0], v.repeat_interleave(2, dim=1), atol=1e-12)


@pytest.mark.parametrize("t,top_k", [(13, 4), (9, 9), (6, 1)])
def test_topk_attention_equals_dense_masked(t, top_k):
    q, k, v = _attn_inputs(t, seed=3)
    scores = torch.randn(2, t, t, dtype=torch.float64)
    idx, valid = select_topk(scores, top_k)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    picked = torch.gather(causal.expand(2, t, t), 2, idx)
    assert bool((picked | ~valid).all())  # never a future key
    assert valid.sum(-1).tolist() == [[min(i + 1, top_k) for i in range(t)]] * 2
    outs, grads = [], []
    for fn in (topk_attention, dense_topk_attention):
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        o = fn(*xs, idx, valid)
        (o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)).sum().backward()
        outs.append(o.detach())
        grads.append([x.grad for x in xs])
    assert rel_err(outs[0], outs[1], "rms") <= 1e-12
    for a, b in zip(*grads):  # absolute floor: with one visible key the q gradient is exactly 0
        assert (a - b).pow(2).mean().sqrt() <= 1e-12 * max(1.0, b.pow(2).mean().sqrt().item())
    if top_k >= t:  # every earlier key selected: plain causal attention
        assert rel_err(outs[0], causal_attention(q, k, v), "rms") <= 1e-12


@pytest.mark.parametrize("pattern", ["L", "M", "G"])
def test_mixer_modules_chunk_equals_naive_with_all_gradients(pattern):
    """Whole models (float64) with the chunked ops vs the naive ones: logits and every parameter
    gradient (the projections, convolutions, A_log, dt_bias, D and gated norms)."""
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_hidden=64, max_seq_len=64,
                      layer_pattern=pattern, linear_chunk_size=4, mamba_state_dim=8, mamba_head_dim=8,
                      linear_heads=2, linear_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
    model = build_model(cfg, dtype=torch.float64)
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
    assert ga.keys() == gb.keys() and any("attention." in n for n in ga)
    for n in ga:
        assert rel_err(ga[n], gb[n], "rms") <= 1e-8, n


def test_dsa_indexer_loss_trains_only_the_indexer():
    """The KL indexer loss (DeepSeek-V3.2-Exp): gradients of the main weights are those of the
    language-model objective alone (eval mode skips the indexer loss), and the indexer's gradients
    equal those of the KL written here densely (full masked softmaxes instead of the gathered form)."""
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=64,
                      layer_pattern="D", dsa_top_k=5, dsa_index_heads=2)
    layer = build_model(cfg, dtype=torch.float64).layers["0"].attention
    x = torch.randn(2, 11, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    cos, sin = (t[:11].double() for t in rope_tables(cfg))
    w = torch.randn(2, 11, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    grads = {}
    for mode in ("train", "eval"):
        layer.train(mode == "train")
        layer.zero_grad()
        (layer(x, cos, sin) * w).sum().backward()
        grads[mode] = {n: None if p.grad is None else p.grad.clone() for n, p in layer.named_parameters()}
    main = [n for n in grads["train"] if "index" not in n]
    for n in main:
        assert torch.allclose(grads["train"][n], grads["eval"][n], rtol=1e-12, atol=1e-14), n
    assert all(grads["eval"][n] is None for n in grads["eval"] if "index" in n)
    # dense reference of the indexer loss
    layer.zero_grad()
    with torch.no_grad():
        b, t, d = 2, 11, layer.head_dim
        q = layer.wq(x).view(b, t, 4, d)
        k = layer.wk(x).view(b, t, 2, d)
        q, k = apply_rope(q, cos, sin).transpose(1, 2), apply_rope(k, cos, sin).transpose(1, 2)
        k = k.repeat_interleave(2, dim=1)  # (B, H, T, D)
    scores, _ = layer.index_scores(x, cos, sin)  # (B, T, T), with grad to the indexer
    idx, valid = select_topk(scores.detach(), 5)
    mask = torch.zeros(b, t, t, dtype=torch.bool).scatter_(2, idx, valid)
    att = (q @ k.transpose(-1, -2) * d ** -0.5).masked_fill(~mask[:, None], float("-inf")).softmax(-1)
    p = att.sum(1)
    p = p / p.sum(-1, keepdim=True)  # (B, T, T), zero off the selection
    logq = scores.masked_fill(~mask, float("-inf")).log_softmax(-1)
    kl = torch.where(mask, p * (p.clamp_min(1e-30).log() - logq.masked_fill(~mask, 0.0)), 0.0).sum(-1)
    kl.mean(-1).sum().backward()
    for n, prm in layer.named_parameters():
        if "index" in n:
            assert grads["train"][n].abs().max() > 0
            assert rel_err(grads["train"][n], prm.grad, "rms") <= 1e-10, n


def test_gdn_and_mamba2_match_the_transformers_modules():
    """Same parameter names and shapes as ``transformers``' Qwen3NextGatedDeltaNet and Mamba2Mixer,
    and the same outputs for the same (perturbed) weights. Tolerance 1e-5 relative: the
    ``transformers`` reference paths run their recurrences in float32 even for float64 modules
    (observed ~3e-7)."""
    try:
        from transformers import Mamba2Config, Qwen3NextConfig
        from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet
    except ImportError as e:  # pragma: no cover - depends on the installed transformers
        pytest.skip(f"transformers lacks Qwen3-Next / Mamba-2: {e}")
    from ndtrain.model.gated_deltanet import GatedDeltaNet
    from ndtrain.model.mamba2 import Mamba2

    torch.manual_seed(0)
    hf_gdn = Qwen3NextGatedDeltaNet(Qwen3NextConfig(
        hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=1, layer_types=["linear_attention"],
        num_attention_heads=4, num_key_value_heads=2), 0)
    gdn = GatedDeltaNet(ModelConfig(dim=32, n_heads=4, n_layers=1, linear_heads=2, linear_value_heads=4,
                                    linear_key_head_dim=8, linear_value_head_dim=8, linear_chunk_size=4), "0")
    hf_m2 = Mamba2Mixer(Mamba2Config(hidden_size=32, state_size=8, expand=2, head_dim=8, num_heads=8, n_groups=1,
                                     conv_kernel=4, chunk_size=4, num_hidden_layers=1), 0)
    m2 = Mamba2(ModelConfig(dim=32, n_heads=4, n_layers=1, mamba_state_dim=8, mamba_head_dim=8, mamba_expand=2,
                            linear_chunk_size=4), "0")
    x = torch.randn(2, 13, 32, dtype=torch.float64)
    for hf, ours in ((hf_gdn, gdn), (hf_m2, m2)):
        hf, ours = hf.double(), ours.double()
        sd = {k: v + 0.1 * torch.randn_like(v) for k, v in hf.state_dict().items()}
        assert {k: v.shape for k, v in sd.items()} == {k: v.shape for k, v in ours.state_dict().items()}
        hf.load_state_dict(sd)
        ours.load_state_dict(sd)
        with torch.no_grad():
            ref = hf(x)
            assert rel_err(ours(x), ref, "rms") <= 1e-5
            # and the naive twin of our op gives the same module output
            mixers.LINEAR_IMPL["impl"] = "naive"
            try:
                assert rel_err(ours(x), ref, "rms") <= 1e-5
            finally:
                mixers.LINEAR_IMPL["impl"] = "chunk"
