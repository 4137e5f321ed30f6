"""The batch agreement of a step (``Trainer._agree_on_batch``: global valid-label count, equal local
batch sizes) overlapped with the first forward under plain DDP.

Reference: the same trainer with the blocking agreement (``overlap_agree = False``, what every
other layout runs), on the same local batches of 10%..100% valid labels: loss, gradient norm, token
count and every parameter after the step must be bitwise equal (the denominator is the same
float, only the time it is known changes). The token count must equal the global batch's valid
labels counted in the test. Errors: a rank holding no sequences (it runs no forward) and an empty
global batch raise the same ValueError on both ranks with no hang (a hang fails by timeout), and
the trainer then still trains.
"""
from __future__ import annotations

import pytest
import torch

from ndtrain.config import validate
from ndtrain.mesh import ParallelDims
from ndtrain.train.trainer import IGNORE_INDEX, Trainer
from tests.dist_utils import run_ranks
from tests.parallel.test_pp import global_batch, pp_cfg


def _trainer(world: int) -> Trainer:
    cfg = pp_cfg(1, zero_stage=0)
    validate(cfg, world)
    return Trainer(cfg, ParallelDims.from_config(cfg.parallel, world).build_mesh(), torch.device("cpu"))


def _ranks(rank: int, world: int) -> dict:
    overlap, blocking = _trainer(world), _trainer(world)
    blocking.overlap_agree = False
    x, y = global_batch(0)
    n = x.shape[0] // world
    xl, yl = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
    a, b = overlap.step(xl, yl), blocking.step(xl, yl)
    same_params = all(torch.equal(p, q) for p, q in zip(overlap.model.parameters(), blocking.model.parameters()))
    errors = []
    for rows in ((2, 0), (0, 0)):  # rank 1 holds nothing; then nobody does
        k = rows[rank]
        with pytest.raises(ValueError) as err:
            overlap.step(x[:k], y[:k])
        errors.append(str(err.value))
    after = overlap.step(xl, yl)  # the group is still usable
    return {"overlap": overlap.overlap_agree, "a": a, "b": b, "same_params": same_params,
            "errors": errors, "after_loss": after["loss"], "n_valid": float((y != IGNORE_INDEX).sum())}


def test_overlapped_batch_agreement_equals_the_blocking_one_and_fails_together():
    torch.set_num_threads(1)
    results = run_ranks(_ranks, 2, timeout_s=300)
    for r in results:
        assert r["overlap"]  # plain DDP at pp 1 takes the overlapped path
        for key in ("loss", "grad_norm", "n_tokens"):
            assert r["a"][key] == r["b"][key], key
        assert r["a"]["n_tokens"] == r["n_valid"]
        assert r["same_params"]
        assert "local batch sizes differ across the 2 data-parallel x cp ranks (2 sequences in all" in r["errors"][0]
        assert r["errors"][1] == "empty batch: every rank holds 0 sequences"
        assert r["after_loss"] == r["after_loss"] and r["after_loss"] > 0  # finite, trained
    assert results[0]["errors"] == results[1]["errors"]
