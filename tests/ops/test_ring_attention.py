"""Ring attention (``ndtrain.parallel.cp.ring``) against full attention.

Reference: ``F.scaled_dot_product_attention`` over the whole sequence with an explicit boolean mask
(causal and/or same-document), differentiated by autograd. The ring is run (a) as a single-process
simulation that executes the same block / merge / block-backward steps in ring order, and (b) for
real over gloo with 2 ranks. Tolerance 1e-10 absolute in float64: the two only differ in the order
of exp / sum operations (online softmax vs one softmax), i.e. a few ulps of values O(1).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ndtrain.mesh import ParallelDims
from ndtrain.parallel.cp.context_parallel import local_positions, shard_sequence, unshard_sequence
from ndtrain.parallel.cp.ring import ring_attention, simulate_ring_attention
from tests.dist_utils import run_ranks

B, H, G, T, D = 2, 4, 2, 16, 8
TOL = 1e-10


def make_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, dtype=torch.float64, generator=g)
    k = torch.randn(B, G, T, D, dtype=torch.float64, generator=g)
    v = torch.randn(B, G, T, D, dtype=torch.float64, generator=g)
    dout = torch.randn(B, H, T, D, dtype=torch.float64, generator=g)
    return q, k, v, dout


def packed_docs(boundary: int = 5) -> torch.Tensor:
    """(B, T) document ids: sample 0 holds two documents split at ``boundary`` (inside a shard for
    every layout used here), sample 1 three documents."""
    doc = torch.zeros(B, T, dtype=torch.long)
    doc[0, boundary:] = 1
    doc[1, 3:] = 1
    doc[1, 11:] = 2
    return doc


def reference(q, k, v, dout, causal, doc):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    mask = torch.ones(T, T, dtype=torch.bool)
    if causal:
        mask = torch.tril(mask)
    mask = mask[None, None].expand(B, 1, T, T)
    if doc is not None:
        mask = mask & (doc[:, :, None] == doc[:, None, :])[:, None]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def shards(x, cp, layout, dim=2):
    return [shard_sequence(x, cp, r, layout, dim) for r in range(cp)]


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("layout", ["load_balanced", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("docs", [False, True])
def test_simulated_ring_matches_full_attention(cp, layout, causal, docs):
    q, k, v, dout = make_inputs()
    doc = packed_docs() if docs else None
    if docs:  # a shard whose queries have no valid labels: its output gradient is zero
        dout = unshard_sequence([d if r != cp - 1 else torch.zeros_like(d) for r, d in
                                 enumerate(shards(dout, cp, layout))], layout, dim=2)
    ref_out, ref_dq, ref_dk, ref_dv = reference(q, k, v, dout, causal, doc)
    pos = torch.stack([local_positions(T, cp, r, layout) for r in range(cp)])  # (cp, T/cp)
    doc_sh = None if doc is None else torch.stack(shards(doc, cp, layout, dim=1))  # (cp, B, T/cp)
    outs, backward = simulate_ring_attention(shards(q, cp, layout), shards(k, cp, layout),
                                             shards(v, cp, layout), pos, pos, causal, doc_sh, doc_sh)
    dqs, dks, dvs = backward(shards(dout, cp, layout))
    for got, want in ((outs, ref_out), (dqs, ref_dq), (dks, ref_dk), (dvs, ref_dv)):
        assert (unshard_sequence(got, layout, dim=2) - want).abs().max() < TOL
    assert ref_dk.abs().max() > 0.1  # the comparison is not vacuous


def test_boundary_falls_inside_a_shard():
    """The packed-document case really splits a shard: document 0 ends at position 5, inside chunk 1
    of the load-balanced cp=2 layout (chunks of 4), and in the middle of rank 0's contiguous half."""
    doc = packed_docs()
    for layout in ("load_balanced", "contiguous"):
        sh = shards(doc, 2, layout, dim=1)
        assert any(len(set(s[0].tolist())) == 2 for s in sh)


def _ring_gloo(rank: int, world: int) -> dict:
    mesh = ParallelDims(cp=world, world_size=world).build_mesh()
    group = mesh.group("cp")
    q, k, v, dout = make_inputs(1)
    doc = packed_docs()
    out = {}
    for layout in ("load_balanced", "contiguous"):
        for causal in (True, False):
            for docs in (False, True):
                d = doc if docs else None
                ref = reference(q, k, v, dout, causal, d)
                pos = torch.stack([local_positions(T, world, r, layout) for r in range(world)])
                doc_sh = None if d is None else torch.stack(shards(d, world, layout, dim=1))
                ql, kl, vl = (shard_sequence(x, world, rank, layout, 2).requires_grad_() for x in (q, k, v))
                mesh.reset_stats()
                o = ring_attention(ql, kl, vl, group, pos[rank], pos, causal,
                                   None if doc_sh is None else doc_sh[rank], doc_sh)
                fwd_bytes = mesh.reset_stats().get("cp", 0.0)
                o.backward(shard_sequence(dout, world, rank, layout, 2))
                bwd_bytes = mesh.reset_stats().get("cp", 0.0)
                err = max((o.detach() - shard_sequence(ref[0], world, rank, layout, 2)).abs().max().item(),
                          *((x.grad - shard_sequence(r, world, rank, layout, 2)).abs().max().item()
                            for x, r in zip((ql, kl, vl), ref[1:])))
                out[(layout, causal, docs)] = (err, fwd_bytes, bwd_bytes)
    return out


def test_ring_attention_gloo_two_ranks():
    """Real ring over gloo (cp=2): output and dQ/dK/dV equal full attention for both layouts, causal
    and not, with and without packed documents. Bytes: forward sends (cp-1) K/V blocks, backward
    (cp-1) K/V blocks plus cp dK/dV blocks (float64 here)."""
    res = run_ranks(_ring_gloo, 2, timeout_s=120)
    kv_block = 2 * B * G * (T // 2) * D * 8
    for r in res:
        for key, (err, fwd, bwd) in r.items():
            assert err < TOL, key
            assert fwd == 1 * kv_block
            assert bwd == 1 * kv_block + 2 * kv_block
