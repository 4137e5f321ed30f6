"""The plain 1F1B reference executor (``pp/reference.py``) against the action-list runtime's 1F1B
and against one process running the whole model.

pp = 2 and pp = 4 gloo processes, float64, a tiny Llama-style model (4 blocks, so one per stage at
pp = 4), untied, m in {1, 3, 6} over a local batch of 8 (3 gives uneven microbatches 3, 3, 2; 1 and
3 < p at pp = 4 exercise short steady states). Each rank builds its stage twice (identical weights
by per-name seeding): one copy runs ``reference.run_1f1b``, the other ``PipelineRuntime(...,
"1f1b")``, on the same batch. Per-microbatch losses (last stage) and every gradient must be
**bitwise** equal: both run the same forward and backward operations on the same tensors in the
same order (microbatch backwards in order 0..m-1, so ``.grad`` accumulates identically), and p2p
messages are exact copies; only the order of communication differs. The single-process reference
runs the full model on the same microbatches in order (forward, ``loss / denom``, backward); it is
also bitwise equal, because a stage boundary only hands the same activation / gradient tensor
across, without changing any arithmetic.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.dist_utils import run_ranks
from tests.utils import tiny_config

V, T, B = 48, 6, 8
MS = (1, 3, 6)


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")


def _cfg(pp: int):
    """The schema's trainer defaults (lr, warmup, clipping) on a 4-layer model: pp cuts it in 2 or 4."""
    return tiny_config({"model.vocab_size": V, "model.dim": 16, "model.n_layers": 4, "model.n_heads": 2,
                        "model.n_kv_heads": 1, "model.ffn_hidden": 24, "model.max_seq_len": 16, "data.seq_len": T,
                        "training.global_batch_size": B, "training.steps": 100, "training.lr": 3e-4,
                        "training.warmup_steps": 10, "training.grad_clip": 1.0,
                        "parallel.bucket_size_bytes": 25 * 2**20}, parallel={"pp": pp})


def _batch() -> tuple[torch.Tensor, torch.Tensor, float]:
    g = torch.Generator().manual_seed(7)
    x, y = torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)
    y = y.masked_fill(torch.rand(B, T, generator=g) < 0.3, -100)
    return x, y, float((y != -100).sum())


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: q.grad.clone() for n, q in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def _compare(rank: int, world: int) -> dict:
    from ndtrain.mesh import ParallelDims
    from ndtrain.model import build_model
    from ndtrain.parallel.pp.reference import run_1f1b
    from ndtrain.parallel.pp.runtime import PipelineRuntime
    from ndtrain.parallel.pp.stage import build_pipeline_stage, stage_chunks

    cfg = _cfg(world)
    mesh = ParallelDims(pp=world, world_size=world).build_mesh()
    group = mesh.group("pp")
    x, y, denom = _batch()
    ref_stage = build_pipeline_stage(cfg, mesh, torch.device("cpu"), torch.float64, seed=3)
    rt_stage = build_pipeline_stage(cfg, mesh, torch.device("cpu"), torch.float64, seed=3)
    full = build_model(cfg.model, torch.device("cpu"), torch.float64, 3)
    rt = PipelineRuntime(stage_chunks(rt_stage), group, "1f1b", _loss)
    out = {}
    for m in MS:
        losses_ref = run_1f1b(ref_stage, group, _loss, x, y, m, denom)
        rt.run(x, y, m, denom)
        single_losses = []
        for xm, ym in zip(x.tensor_split(m), y.tensor_split(m)):  # one process, microbatches in order
            ls = _loss(full(xm), ym)
            single_losses.append(ls.detach().double())
            (ls / denom).backward()
        g_ref, g_rt, g_one = _grads(ref_stage), _grads(rt_stage), _grads(full)
        last = rank == world - 1
        out[m] = {
            "n_losses": (len(losses_ref), len(rt.microbatch_losses)),
            "losses_equal": all(torch.equal(a, b) for a, b in zip(losses_ref, rt.microbatch_losses)),
            "losses_single": (not last) or all(torch.equal(a, b) for a, b in zip(losses_ref, single_losses)),
            "grads_equal": [n for n in g_ref if not torch.equal(g_ref[n], g_rt[n])],
            "grads_single": [n for n in g_ref if not torch.equal(g_ref[n], g_one[n])],
            "n_grads": len(g_ref),
            "nonzero": all(g.abs().sum() > 0 for g in g_ref.values()),
        }
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_reference_1f1b_equals_runtime_and_single_process(world):
    res = run_ranks(_compare, world, timeout_s=240)
    for rank, r in enumerate(res):
        for m, e in r.items():
            last = rank == world - 1
            assert e["n_losses"] == ((m, m) if last else (0, 0)), (rank, m, e)
            assert e["losses_equal"] and e["losses_single"], (rank, m, e)
            assert e["grads_equal"] == [] and e["grads_single"] == [], (rank, m, e)
            assert e["n_grads"] > 0 and e["nonzero"], (rank, m, e)
    # every parameter of the model is held by exactly one stage: 4 blocks x 9 + embedding, norm, head
    assert sum(r[1]["n_grads"] for r in res) == 4 * 9 + 3
