"""A stage's sent outputs are freed once handed to the send (``pp.stage.release_sent_output``).

One spawn of 2 gloo ranks (pp2, float64, 4 microbatches, 2 steps) trains the same model with the
release on and off (``stage.RELEASE_SENT``, the reference that keeps each output whole), under
1F1B, interleaved (v = 2) and ZB-H1 (whose B pass differentiates with ``autograd.grad`` rather
than ``backward``). Losses, gradient norms and every parameter after the steps must be bitwise
equal: the backward reads only the output's node and shape. At the start of every B action on
stage 0 the outputs the runtime still holds for the (microbatch, chunk) pairs in flight are
summed: with the release each is one element (8 bytes), without it (B, T, C) float64, so the sum
falls from 8 x pairs x T x C to 8 x pairs bytes. Before the release existed the sum was the
whole outputs', so this test fails there.
"""
from __future__ import annotations

import torch

from ndtrain.mesh import ParallelDims
from ndtrain.parallel.pp import stage
from ndtrain.parallel.pp.observe import RuntimeObserver
from ndtrain.train.loop import Trainer
from tests.dist_utils import run_ranks
from tests.parallel.test_pp import C, T, global_batch, pp_cfg

M = 4  # microbatches of the 8-sequence batch (test_pp's G): two rows each


class _HeldOutputs(RuntimeObserver):
    """Bytes of the outputs the runtime holds for backward, at the start of each B action."""

    def __init__(self, runtime):
        self.runtime, self.at_b = runtime, []

    def on_action_start(self, a) -> None:
        if a.kind != "B":
            return
        saved = self.runtime._step.saved
        outs = [s["out"] for s in saved.values() if s.get("out") is not None]
        self.at_b.append((len(outs), sum(o.untyped_storage().nbytes() for o in outs)))


def _train(sched: str, v: int, release: bool) -> dict:
    stage.RELEASE_SENT = release
    try:
        cfg = pp_cfg(2, sched, m=M, v=v)
        tr = Trainer(cfg, ParallelDims.from_config(cfg.parallel, 2).build_mesh(), torch.device("cpu"))
        held = _HeldOutputs(tr.pipeline.runtime)
        tr.pipeline.runtime.observers.append(held)
        out = [tr.step(*global_batch(s)) for s in range(2)]
        return {"loss": [o["loss"] for o in out], "gn": [o["grad_norm"] for o in out],
                "params": {n: q.detach().clone() for n, q in tr.model.named_parameters()}, "held": held.at_b}
    finally:
        stage.RELEASE_SENT = True


def _ranks(rank: int, world: int) -> dict:
    res = {}
    for sched, v in (("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1)):
        on, off = _train(sched, v, True), _train(sched, v, False)
        assert on["loss"] == off["loss"] and on["gn"] == off["gn"], sched
        for n, q in on["params"].items():
            assert torch.equal(q, off["params"][n]), (sched, n)
        res[sched] = {"on": on["held"], "off": off["held"]}
    return res


def test_sent_outputs_are_freed_and_training_is_bitwise_unchanged():
    first, last = run_ranks(_ranks, 2)
    whole = 8 * (8 // M) * T * C  # one float64 (rows, T, C) output: 8 sequences in M microbatches
    for sched, held in first.items():
        assert held["on"] and len(held["on"]) == len(held["off"]), sched
        for (n_on, b_on), (n_off, b_off) in zip(held["on"], held["off"]):
            assert n_on == n_off >= 1, sched
            assert b_on == 8 * n_on, (sched, b_on)  # one element each
            assert b_off == whole * n_off, (sched, b_off)  # the reference keeps them whole
        assert max(n for n, _ in held["on"]) >= 2, sched  # pairs in flight on stage 0
    for sched, held in last.items():  # the head's stage holds its 0-d losses either way
        if sched != "interleaved":  # (interleaved: its first chunk is not the head and sends)
            assert all(b == 8 * n for n, b in held["on"] + held["off"]), sched
