"""The MoE token mask (``MoE.token_mask``): a (B, T) run whose last k positions are masked equals
the single-process run on the truncated (B, T - k) input, in outputs at the valid positions,
gradients, every auxiliary loss, the loads and the capacity decision (items 4 / 7: MTP
depths run padded under sequence / context parallel). Single process; the cp shards are simulated
(``SequenceShards`` whose collectives act on a list of per-shard tensors), float64.

Reference: the same MoE on the truncated input. Tolerances 1e-12 (outputs, aux terms) and 1e-10
(parameter gradients, summed over more rows) in float64: the masked run adds exact zeros for the
masked rows and otherwise reorders the same sums; counts, loads and kept-token sets are compared
exactly. A mask that leaked the tail into any statistic moves it by O(1 / T)."""
from __future__ import annotations

import math

import pytest
import torch

from ndtrain.model.moe import MoE
from ndtrain.model.moe_capacity import SequenceShards, capacity_keep
from tests.unit.test_moe import tiny


def _moe(cf: float) -> MoE:
    torch.manual_seed(0)
    cfg = tiny(moe_score="sigmoid", moe_n_groups=2, moe_topk_groups=2, moe_shared_experts=1,
               moe_aux_loss_coef=0.01, moe_seq_aux_loss_coef=0.02, moe_z_loss_coef=0.003,
               moe_capacity_factor=cf)
    moe = MoE(cfg).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    moe.expert_bias.copy_(torch.linspace(-0.2, 0.2, cfg.moe_experts))
    return moe.train()


def _run(moe: MoE, x: torch.Tensor, valid: torch.Tensor | None):
    x = x.clone().requires_grad_()
    moe.stats.reset()
    moe.token_mask = valid
    out = moe(x)
    moe.token_mask = None
    st = moe.stats
    return out, moe.aux_sum, (st.counts.clone(), st.assigned, st.dropped, dict(st.terms)), x


@pytest.mark.parametrize("cf", [0.0, 1.0])
def test_masked_tail_equals_truncated_run(cf):
    b, t, k_pad = 3, 12, 2
    moe = _moe(cf)
    x = torch.randn(b, t, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    valid = torch.arange(t) < t - k_pad
    valid = valid.expand(b, t)
    out_m, aux_m, st_m, x_m = _run(moe, x, valid)
    out_t, aux_t, st_t, x_t = _run(moe, x[:, :t - k_pad], None)
    g = torch.randn_like(out_t)
    ((out_m[:, :t - k_pad] * g).sum() + aux_m).backward()
    grads_m = [p.grad.clone() for p in moe.parameters()]
    moe.zero_grad()
    ((out_t * g).sum() + aux_t).backward()
    torch.testing.assert_close(out_m[:, :t - k_pad], out_t, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(aux_m, aux_t, rtol=1e-12, atol=0)
    torch.testing.assert_close(x_m.grad[:, :t - k_pad], x_t.grad, rtol=1e-12, atol=1e-12)
    assert x_m.grad[:, t - k_pad:].abs().max() == 0  # the tail's outputs were not part of the loss
    for gm, p in zip(grads_m, moe.parameters()):
        torch.testing.assert_close(gm, p.grad, rtol=1e-10, atol=1e-12)
    assert torch.equal(st_m[0], st_t[0]) and st_m[1:3] == st_t[1:3]
    assert st_m[1] == b * (t - k_pad) * moe.top_k
    assert st_m[3].keys() == st_t[3].keys() == {"switch", "seq", "z"}
    for name, v in st_t[3].items():
        assert math.isclose(st_m[3][name], v, rel_tol=1e-12), name
    if cf > 0:
        assert 0 < st_t[2] < st_t[1] / 2  # capacity really drops some assignments


def _simulated_shards(chunks, rank, store):
    """Shards whose all_gather returns the tensors every shard put into ``store`` (filled in a
    first pass), so ``capacity_keep`` can run one shard at a time in one process."""
    def all_gather(x):
        store[rank] = x.clone()
        return torch.stack([store.get(r, torch.zeros_like(x)) for r in range(len(chunks))])

    return SequenceShards(rank, chunks, lambda x: x, all_gather)


def test_capacity_with_mask_over_cp_shards_equals_truncated():
    """Load-balanced cp2 chunks (rank 0: chunks 0 and 3, rank 1: 1 and 2) of B=2 sequences of
    T=16 with the last 3 positions masked: every shard's keep equals the single process's decision
    on the (B, 13) truncated microbatch, and masked assignments are never kept."""
    g = torch.Generator().manual_seed(3)
    b, t, k, e, cf, pad = 2, 16, 2, 4, 1.0, 3
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(b * t)]).view(b, t, k)
    want = capacity_keep(idx[:, :t - pad].reshape(-1, k), (b, t - pad), e, cf)  # (B (T-pad), k)
    valid = (torch.arange(t) < t - pad).expand(b, t)
    chunks = ((0, 3), (1, 2))
    c = t // 4
    pos = [torch.cat([torch.arange(i * c, (i + 1) * c) for i in ids]) for ids in chunks]
    store: dict = {}
    got = torch.zeros(b, t, k, dtype=torch.bool)
    for _ in range(2):  # pass 1 fills the gather store, pass 2 reads the complete gather
        for r, p in enumerate(pos):
            sh = _simulated_shards(chunks, r, store)
            keep = capacity_keep(idx[:, p].reshape(-1, k), (b, t // 2), e, cf, sh, valid[:, p].reshape(-1))
            got[:, p] = keep.view(b, t // 2, k)
    assert torch.equal(got[:, :t - pad].reshape(-1, k), want)
    assert not got[:, t - pad:].any()
    assert 0 < int((~want).sum()) < want.numel()


def test_mask_shape_is_checked():
    moe = _moe(0.0)
    moe.token_mask = torch.ones(2, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match="token mask"):
        moe(torch.zeros(2, 4, 32, dtype=torch.float64))
