"""QK-clip (MuonClip) in one process, float64: the step equals the no-clip Muon step with each
head's wq / wk rows scaled by hand from maxima computed by explicit loops; the rules' errors."""
from __future__ import annotations

import math

import pytest
import torch

from ndtrain.config import validate
from ndtrain.errors import ConfigError
from ndtrain.mesh import ParallelDims
from ndtrain.model.attention import Attention
from ndtrain.parallel.muon.qk_clip import qk_scales
from ndtrain.train.loop import Trainer
from tests.parallel import layout_parity as lp


def _cfg(tau: float = 0.0):
    cfg = lp.tiny_cfg(1)
    t = cfg.training
    t.optimizer, t.lr, t.weight_decay, t.qk_clip = "muon", 1e-2, 0.1, tau
    validate(cfg, 1)
    return cfg


def _trainer(tau: float) -> Trainer:
    torch.manual_seed(0)
    return Trainer(_cfg(tau), ParallelDims(world_size=1).build_mesh(), torch.device("cpu"))


def _loop_maxima(tr: Trainer, inputs, labels) -> dict[str, torch.Tensor]:
    """Per attention module, (H,) max over batch and pairs s <= t of q_t . k_s / sqrt(D), by loops
    over the q / k that ``project`` returns in a forward of the current weights."""
    seen = {}

    def loops(q, k) -> torch.Tensor:
        b, h, t, d = q.shape
        r = h // k.shape[1]
        best = torch.full((h,), -math.inf, dtype=torch.float64)
        for bi in range(b):
            for hi in range(h):
                for ti in range(t):
                    for si in range(ti + 1):
                        best[hi] = max(best[hi], float(q[bi, hi, ti] @ k[bi, hi // r, si]) / math.sqrt(d))
        return best

    for name, m in tr.model.named_modules():
        if type(m) is Attention:
            def wrapped(*a, orig=m.project, name=name):
                out = orig(*a)
                seen[name] = loops(out[0].detach(), out[1].detach())
                return out
            m.project = wrapped  # an instance attribute over the method, deleted below
    with torch.no_grad():
        tr.plan.eval_loss_sum(inputs, labels, None)
    for _, m in tr.model.named_modules():
        if type(m) is Attention:
            del m.project
    return seen


def test_qk_clip_step_equals_the_muon_step_with_heads_scaled_by_hand():
    inputs, labels = lp.global_batch(0)
    probe = _trainer(0.0)
    maxima = _loop_maxima(probe, inputs, labels)  # the initial weights' logits, by loops
    allm = torch.cat(list(maxima.values()))
    tau = float(allm.median())  # about half the heads exceed it
    plain = _trainer(0.0)
    clip = _trainer(tau)
    plain.step(inputs, labels)
    clip.step(inputs, labels)
    assert 0 < clip.optimizer.qk_clip.clipped < allm.numel()
    want = dict(plain.model.named_parameters())
    worst = 0.0
    for name, m in clip.model.named_modules():
        if type(m) is not Attention:
            continue
        gamma = (tau / maxima[name]).clamp(max=1.0)
        g, d = m.wk.weight.shape[0] // m.head_dim, m.head_dim
        kmin = gamma.view(g, -1).amin(1)
        sq = gamma / kmin.sqrt().repeat_interleave(gamma.numel() // g)  # Kimi's sqrt(gamma) split for GQA
        wq = want[f"{name}.wq.weight"] * sq.repeat_interleave(d)[:, None]
        wk = want[f"{name}.wk.weight"] * kmin.sqrt().repeat_interleave(d)[:, None]
        worst = max(worst, (m.wq.weight - wq).abs().max().item(), (m.wk.weight - wk).abs().max().item())
        # every head's logits scale by its own gamma: q scale x its key head's scale
        assert torch.allclose(sq * kmin.sqrt().repeat_interleave(gamma.numel() // g), gamma, rtol=1e-14)
    assert worst < 1e-14, worst
    others = [n for n, _ in clip.model.named_parameters() if ".wq." not in n and ".wk." not in n]
    assert all(torch.equal(dict(clip.model.named_parameters())[n], want[n]) for n in others)


def test_qk_scales_mha_is_kimis_square_root():
    gamma = torch.tensor([1.0, 0.25, 0.5, 1.0], dtype=torch.float64)
    sq, sk = qk_scales(gamma, 4)
    assert torch.equal(sk, gamma.sqrt()) and torch.allclose(sq, gamma.sqrt(), rtol=0, atol=1e-15)
    sq, sk = qk_scales(gamma, 2)  # groups (1, 0.25), (0.5, 1)
    assert torch.allclose(sk, torch.tensor([0.5, 0.5 ** 0.5], dtype=torch.float64), rtol=0, atol=1e-15)
    assert torch.allclose(sq * sk.repeat_interleave(2), gamma, rtol=0, atol=1e-15)


def test_a_skipped_step_drops_its_maxima():
    tr = _trainer(1.0)
    inputs, labels = lp.global_batch(0)
    with torch.no_grad():
        tr.model.train()
        tr.plan.eval_loss_sum(inputs, labels, None)  # a training-mode forward records
    mods = [t.module for t in tr.optimizer.qk_clip.targets]
    assert all(m.logit_max.numel() > 0 for m in mods)
    tr.optimizer.zero_grad()
    assert all(m.logit_max.numel() == 0 for m in mods)


@pytest.mark.parametrize("keys, msg", [
    ({"training.optimizer": "adamw"}, "training.qk_clip needs training.optimizer: muon (got adamw): it is MuonClip's step"),
    ({"model.qk_norm": True}, "training.qk_clip with model.qk_norm: the norm undoes any scaling of wq / wk"),
    ({"model.layer_pattern": "AS"}, ("training.qk_clip: layers ['sliding_window'] mask logits their own way; "
                                     "qk_clip records plain causal attention only")),
    ({"parallel.cp": 2}, ("training.qk_clip needs parallel.cp 1 (got 2): a cp rank holds only its chunk's keys, "
                          "so its logit maxima would miss the other chunks'")),
    ({"training.qk_clip": -1.0}, "training.qk_clip (-1.0) must be >= 0 (0 = off)"),
])
def test_qk_clip_rules(keys, msg):
    from tests.utils import tiny_config

    base = {"training.optimizer": "muon", "training.qk_clip": 5.0}
    with pytest.raises(ConfigError) as e:
        tiny_config({**base, **keys}, world=2 if "parallel.cp" in keys else 1)
    assert str(e.value) == msg


def test_max_logit_of_packed_documents_counts_only_pairs_inside_a_document():
    """With documents, the recorded max is over the causal pairs of one document: equal to a loop
    over (row, document, query, key), and below the unmasked max on a batch built so the largest
    logit pairs two documents."""
    from ndtrain.model.attention import head_max_logits

    torch.manual_seed(0)
    b, h, g, t, d = 2, 4, 2, 6, 8
    q, k = torch.randn(b, h, t, d, dtype=torch.float64), torch.randn(b, g, t, d, dtype=torch.float64)
    k[:, :, 0] = 10 * q[:, ::2, 5]  # key 0 (document 0) matches query 5 (document 1) of every head pair
    docs = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 2, 2]])
    want = torch.full((h,), float("-inf"), dtype=torch.float64)
    for r in range(b):
        for hh in range(h):
            for i in range(t):
                for j in range(i + 1):
                    if docs[r, i] == docs[r, j]:
                        want[hh] = max(want[hh], q[r, hh, i] @ k[r, hh // (h // g), j] / math.sqrt(d))
    got = head_max_logits(q, k, docs)
    assert torch.allclose(got, want, rtol=1e-14, atol=0)
    assert (head_max_logits(q, k) > got + 1).all()
