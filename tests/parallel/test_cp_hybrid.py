"""Hybrid (hierarchical) context parallel and work-balanced packed documents against one process.

Hybrid: Ulysses all-to-all inside ``cp_ulysses`` ranks, ring across. 10 float64 steps of the tiny
model (H 4, kv heads 2) next to the single-process ``Trainer`` (``layout_parity``), tolerance 1e-8:
cp4 = 2 x 2 with cp (4) > kv heads (2), causal with a label-free shard on step 3 and bidirectional;
kv heads 1 (replicated to 2); the degenerate splits 4 x 1 (all-to-all only) and 1 x 4 (ring only).
Bytes per axis are checked exactly against the formula written out here (hybrid.py's docstring).
Packed documents: cp4 ring and hybrid with ``cp_doc_balance`` give the single process's losses and
parameters (1e-10) on batches whose documents the mirror layout balances badly, and the measured
work of the busiest rank falls. One spawn of 4 gloo ranks runs every check.
"""
from __future__ import annotations

import pytest
import torch

from ndtrain.config import ConfigError, apply_overrides, validate
from ndtrain.parallel.cp.context_parallel import local_positions
from ndtrain.parallel.cp.doc_balance import balanced_assignment, deal_chunks, imbalance, position_work
from ndtrain.parallel.cp.hybrid import kv_replicas, split_groups
from tests.dist_utils import run_ranks
from tests.parallel.layout_parity import assert_parity, run_layout, theory_bytes, tiny_cfg

HYBRID = {  # name: (run_layout kwargs, (u, R, kv heads))
    "2x2_gqa_hole": (dict(cp=4, cp_impl="hybrid", cp_ulysses=2, hole=True), (2, 2, 2)),
    "2x2_noncausal": (dict(cp=4, cp_impl="hybrid", cp_ulysses=2, causal=False), (2, 2, 2)),
    "2x2_kv1": (dict(cp=4, cp_impl="hybrid", cp_ulysses=2, n_kv_heads=1), (2, 2, 1)),
    "4x1": (dict(cp=4, cp_impl="hybrid", cp_ulysses=4), (4, 1, 2)),
    "1x4_contiguous": (dict(cp=4, cp_impl="hybrid", cp_ulysses=1, cp_layout="contiguous"), (1, 4, 2)),
}
T_DOC, B_DOC, STEPS_DOC = 32, 2, 3


def hybrid_theory(u: int, r: int, g: int, n_params_local: int) -> dict[str, float]:
    """Per step and rank: L=2 layers, B=4, T/cp=4, H=4, D=8, float64; the kv heads replicated to a
    multiple of u. cp_a2a: q, k, v, out through (u-1)/u all-to-alls both ways; cp_ring: (3R-2) K/V
    messages of (B, G'/u, u T/cp, 2D)."""
    L, B, Tl, H, D, b = 2, 4, 4, 4, 8, 8
    gp = g if g % u == 0 else u
    s = B * Tl * D * b
    out = {k: v for k, v in theory_bytes(n_cp=4, n_params_local=n_params_local).items() if k != "cp"}
    if u > 1:
        out["cp_a2a"] = L * 2 * (u - 1) / u * (2 * H + 2 * gp) * s
    if r > 1:
        out["cp_ring"] = L * 2 * (3 * r - 2) * gp * s
    return out


def skewed_batch(step: int):
    """(B, T) inputs, labels and documents: one long document first (20-26 tokens), short ones after,
    which the mirror layout leaves with most of the work on the ranks holding the first chunks' ends."""
    from tests.parallel.test_document_mask import IGNORE_INDEX

    g = torch.Generator().manual_seed(900 + step)
    x = torch.randint(0, 61, (B_DOC, T_DOC + 1), generator=g)
    docs = torch.zeros(B_DOC, T_DOC, dtype=torch.int32)
    for row in range(B_DOC):
        start = 20 + 3 * row + step % 2
        docs[row, start:] = 1
        docs[row, start + 3:] = 2
    labels = x[:, 1:].clone()
    labels[:, :-1][docs[:, 1:] != docs[:, :-1]] = IGNORE_INDEX
    return x[:, :-1], labels, docs


def _doc_cfg(world: int = 1, **par):
    from tests.parallel.test_document_mask import _cfg

    cfg = _cfg("AA", B_DOC, world, **par)
    cfg.data.seq_len = T_DOC
    validate(cfg, world)
    return cfg


def _doc_run(rank: int, world: int, par: dict) -> dict:
    """Losses / parameters of ``par`` on the skewed batches, and each step's work per cp rank (keys its
    queries see, from the positions the batch cut gave it)."""
    from ndtrain.mesh import ParallelDims
    from ndtrain.train.loop import Trainer
    from tests.parallel.test_document_mask import _params

    cfg = _doc_cfg(world, **par)
    mesh = ParallelDims.from_config(cfg.parallel, world).build_mesh()
    tr = Trainer(cfg, mesh, torch.device("cpu"))
    steps, work = [], []
    for s in range(STEPS_DOC):
        x, y, d = skewed_batch(s)
        pos = tr.plan.shard(x, y, d)[2]  # (B, T/cp) RoPE positions: offsets in the documents
        work.append(int((pos + 1).sum()))
        steps.append(tr.step(x, y, d))
    return {"steps": steps, "params": _params(tr), "work": work}


def _rank(rank: int, world: int) -> dict:
    from tests.parallel.test_document_mask import _compare

    out = {name: run_layout(rank, world, **kw) for name, (kw, _) in HYBRID.items()}
    ref = _doc_run(0, 1, {})
    ref_pair = (ref["steps"], ref["params"])
    for name, par in {"ring_mirror": {"cp": 4}, "ring_balanced": {"cp": 4, "cp_doc_balance": True},
                      "hybrid_balanced": {"cp": 4, "cp_impl": "hybrid", "cp_ulysses": 2, "cp_doc_balance": True}}.items():
        got = _doc_run(rank, world, par)
        out[name] = {"err": _compare((got["steps"], got["params"]), ref_pair), "work": got["work"]}
    out["doc_ref_grad_norm"] = ref["steps"][0]["grad_norm"]
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_rank, 4, timeout_s=600)


@pytest.mark.parametrize("name", list(HYBRID))
def test_hybrid_cp_matches_single_process(results, name):
    per_rank = [r[name] for r in results]
    assert_parity(per_rank, tol=1e-8)
    u, r, g = HYBRID[name][1]
    for res in per_rank:
        want = hybrid_theory(u, r, g, res["n_params_local"])
        for got in res["bytes"]:
            assert got == pytest.approx(want, rel=0, abs=0), (got, want)
    if HYBRID[name][0].get("hole"):
        assert per_rank[0]["n_valid_local"][3] == 0 and min(per_rank[0]["n_valid_local"][:3]) > 0


def test_work_balanced_documents_keep_the_loss_and_cut_the_busiest_rank(results):
    assert results[0]["doc_ref_grad_norm"] > 0.05, "clipping should be active"
    for res in results:
        for name in ("ring_mirror", "ring_balanced", "hybrid_balanced"):
            assert res[name]["err"] < 1e-10, (name, res[name]["err"])
    for s in range(STEPS_DOC):
        mirror = max(r["ring_mirror"]["work"][s] for r in results)
        for name in ("ring_balanced", "hybrid_balanced"):
            busiest = max(r[name]["work"][s] for r in results)
            total = sum(r[name]["work"][s] for r in results)
            assert total == sum(r["ring_mirror"]["work"][s] for r in results)  # same tokens, other ranks
            assert busiest < 0.9 * mirror, (name, s, busiest, mirror)


def test_assignment_rules():
    """Sub-groups, kv replication, the deal and the rules, without processes."""
    assert split_groups([10, 11, 12, 13], 2) == ([[10, 11], [12, 13]], [[10, 12], [11, 13]])
    with pytest.raises(ValueError, match=r"cp_ulysses \(3\) must divide cp \(4\)"):
        split_groups([0, 1, 2, 3], 3)
    assert (kv_replicas(2, 2), kv_replicas(1, 2), kv_replicas(2, 4), kv_replicas(4, 2)) == (1, 2, 2, 1)
    _, _, docs = skewed_batch(0)
    work = position_work(docs)
    mirror = torch.stack([local_positions(T_DOC, 4, r, "load_balanced") for r in range(4)])
    best = balanced_assignment(docs, 4)
    assert sorted(best.flatten().tolist()) == list(range(T_DOC))  # every token once
    assert imbalance(work, best) < imbalance(work, mirror)
    assert torch.equal(balanced_assignment(docs, 4), best)  # deterministic
    # chunks of 2: work 9, 2, 2, 3 -> rank 0 takes 9, rank 1 takes 3 then 2, the last 2 goes to rank 0
    dealt = deal_chunks(torch.tensor([8, 1, 1, 1, 1, 1, 1, 2]), 2, 2)
    assert dealt.tolist() == [[0, 1, 4, 5], [2, 3, 6, 7]]


@pytest.mark.parametrize("over,match", [
    ({"parallel.cp": 4, "parallel.cp_impl": "hybrid", "parallel.cp_ulysses": 3},
     r"hybrid cp: cp_ulysses \(3\) does not divide cp \(4\)"),
    ({"parallel.cp": 8, "parallel.cp_impl": "hybrid", "parallel.cp_ulysses": 8, "data.seq_len": 32},
     r"heads per tp rank \(n_heads / tp = 4\) are not divisible by cp_ulysses \(8\)"),
    ({"parallel.cp": 2, "parallel.cp_ulysses": 2}, r"cp_ulysses \(2\) is read only by cp_impl=hybrid"),
    ({"parallel.cp": 2, "parallel.cp_doc_balance": True}, r"cp_doc_balance needs data.document_mask"),
    ({"parallel.cp": 2, "parallel.cp_impl": "ulysses", "parallel.cp_doc_balance": True,
      "data.document_mask": True}, r"cp_doc_balance needs cp_impl ring\|hybrid"),
])
def test_config_rejects_bad_hybrid_layouts(over, match):
    cfg = tiny_cfg()
    apply_overrides(cfg, over)
    with pytest.raises(ConfigError, match=match):
        validate(cfg)
