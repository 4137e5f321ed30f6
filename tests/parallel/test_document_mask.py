"""Packed documents under every axis: a packed batch with ``documents`` trains exactly like its
documents run one by one.

The reference is the single-process ``Trainer`` on the *unpacked* batch: one row per document, the
document at the row start and padding after it (labels -100). Causal mixers never look right, so
each row is that document's own forward; the token-weighted loss over the same valid labels is the
sum of the documents' losses over their count. The packed run (B rows, several documents each, with
``documents``) must give the same loss, gradient norm (clipping active) and parameters after every
AdamW step, float64 to 1e-10, for softmax (``AA``), sliding-window (``SS``), Gated DeltaNet (``GG``)
and Mamba-2 (``MM``) models, on one process and under tp2 (with full activation checkpointing; and
with sequence parallel), cp2 ring, cp2 Ulysses, pp2 and ZeRO-3 (dp2). Without ``documents`` the
packed run differs.

One spawn of 2 gloo ranks runs every layout and model.
"""
from __future__ import annotations

import pytest
import torch

from ndtrain.mesh import ParallelDims
from ndtrain.train.loop import IGNORE_INDEX, Trainer
from tests.dist_utils import run_ranks
from tests.utils import tiny_config

V, T, B, STEPS = 61, 16, 4, 3
PATTERNS = ("AA", "SS", "GG", "MM")
LAYOUTS = {"tp2_ac": {"tp": 2, "ac": "full"}, "tp2_sp": {"tp": 2, "sequence_parallel": True}, "cp2_ring": {"cp": 2},
           "cp2_ulysses": {"cp": 2, "cp_impl": "ulysses"}, "pp2": {"pp": 2}, "zero3": {"zero_stage": 3}}


def _cfg(pattern: str, rows: int, world: int = 1, **par):
    cfg = tiny_config({"model.layer_pattern": pattern, "model.n_layers": len(pattern), "model.swa_window": 3,
                       "model.linear_chunk_size": 3, "model.linear_heads": 2, "model.linear_key_head_dim": 8,
                       "model.mamba_state_dim": 8, "model.mamba_head_dim": 8, "model.mamba_groups": 2, "model.vocab_size": V,
                       "training.global_batch_size": rows, "data.document_mask": True})
    cfg.training.activation_checkpoint = par.pop("ac", "none")
    if par.get("pp"):
        cfg.training.micro_batch_size = 1
    for k, v in {"dp_shard": -1, **par}.items():
        setattr(cfg.parallel, k, v)
    from ndtrain.config import validate

    validate(cfg, world)
    return cfg


def packed_batch(step: int):
    """(B, T) inputs, labels and documents: 1-4 documents per row; a document's last token takes no
    loss unless it ends the row (its next token belongs to another document)."""
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randint(0, V, (B, T + 1), generator=g)
    docs = torch.zeros(B, T, dtype=torch.int32)
    for b in range(B):
        cuts = torch.randperm(T - 1, generator=g)[: b % 4].sort().values + 1  # doc starts
        for c in cuts.tolist():
            docs[b, c:] += 1
    labels = x[:, 1:].clone()
    labels[:, :-1][docs[:, 1:] != docs[:, :-1]] = IGNORE_INDEX
    return x[:, :-1], labels, docs


def unpacked(inputs, labels, docs):
    """One row per document (at the row start, zero tokens and -100 labels after)."""
    rows_x, rows_y = [], []
    for b in range(inputs.shape[0]):
        for d in torch.unique(docs[b]).tolist():
            idx = (docs[b] == d).nonzero().flatten()
            xr, yr = torch.zeros(T, dtype=torch.long), torch.full((T,), IGNORE_INDEX)
            xr[: len(idx)], yr[: len(idx)] = inputs[b, idx], labels[b, idx]
            rows_x.append(xr)
            rows_y.append(yr)
    return torch.stack(rows_x), torch.stack(rows_y)


def _params(tr) -> dict:
    """Whole parameters under single-process names (collective)."""
    return {n: (v.full_tensor() if hasattr(v, "full_tensor") else v.detach().clone())
            for n, v in tr.tensor_state()["model"].items()}


def _run(cfg, world: int, rank: int, batches, with_docs: bool = True):
    mesh = ParallelDims.from_config(cfg.parallel, world).build_mesh()
    tr = Trainer(cfg, mesh, torch.device("cpu"))
    dp = mesh.group("dp")
    steps = []
    for batch in batches:
        local = batch[0].shape[0] // dp.size
        sl = slice(dp.rank * local, (dp.rank + 1) * local)
        x, y, d = (t[sl] if t is not None else None for t in batch)
        steps.append(tr.step(x, y, d if with_docs else None))
    return steps, _params(tr)


def _compare(a, b) -> float:
    steps_a, params_a = a
    steps_b, params_b = b
    errs = [abs(sa[k] - sb[k]) / abs(sb[k]) for sa, sb in zip(steps_a, steps_b) for k in ("loss", "grad_norm")]
    held = [n for n in params_b if n in params_a]  # a pipeline stage holds its own layers
    assert len(held) >= 3, held
    errs += [((params_a[n] - params_b[n]).abs().max() / params_b[n].abs().max()).item() for n in held]
    return max(errs)


def _rank(rank: int, world: int) -> dict:
    packed = [packed_batch(s) for s in range(STEPS)]
    flat = [unpacked(*p) + (None,) for p in packed]
    out = {}
    for pattern in PATTERNS:
        ref = _run(_cfg(pattern, flat[0][0].shape[0]), 1, 0, flat)
        out[(pattern, "one")] = _compare(_run(_cfg(pattern, B), 1, 0, packed), ref)
        out[(pattern, "mask_off")] = _compare(_run(_cfg(pattern, B), 1, 0, packed, with_docs=False), ref)
        out[(pattern, "ref_grad_norm")] = ref[0][0]["grad_norm"]
        for name, par in LAYOUTS.items():
            out[(pattern, name)] = _compare(_run(_cfg(pattern, B, world, **par), world, rank, packed), ref)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_rank, 2)


@pytest.mark.slow
@pytest.mark.parametrize("pattern", PATTERNS)
def test_packed_documents_train_as_one_by_one(results, pattern):
    for per_rank in results:
        assert per_rank[(pattern, "ref_grad_norm")] > 0.05, "clipping should be active"
        for layout in ("one", *LAYOUTS):
            assert per_rank[(pattern, layout)] < 1e-10, (pattern, layout, per_rank[(pattern, layout)])
        assert per_rank[(pattern, "mask_off")] > 1e-4, (pattern, per_rank[(pattern, "mask_off")])
