"""DualPipeV's overlapped F&B pairs in two threads (``parallel.pp_overlap``, ``pp/pairs.py``).

Parity: the ``deepseek_v3_debug`` preset shrunk as in ``test_moe_pp`` (MLA, a dense first layer,
group-limited sigmoid routing, aux-loss-free bias, Switch / sequence-wise / z losses, MTP, shared
expert), float64, 10 steps, under ``pp2 x ep2`` DualPipeV on 4 gloo ranks (ep borrows dp_shard's 2
ranks, so data-parallel hooks and the Switch loss's dp_cp load reducer run too), once with
``pp_overlap=false`` and once with ``true`` (and once more with the shared-expert overlap on as
well). The overlap runs the same operators on the same tensors, only in two threads, so losses,
gradient norms, every gradient the optimizer applies and the final parameters and expert biases
must be BITWISE equal; against the single-process run of the same global batches the contract is
1e-6 relative (the layouts reorder sums, about 1e-13 here). A pair whose threads mixed their
collectives on one group would hang or exchange wrong rows (O(1) errors); a B that fired the
data-parallel hooks early or a lost MoE aux term would move the gradients far above 1e-6.

The run also checks that the overlap happened: each pair's B ran on a worker thread, and in at
least one pair B's and F's execution intervals intersect.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

from ndtrain.errors import ConfigError
from ndtrain.parallel.pp.observe import RuntimeObserver
from tests.dist_utils import run_ranks
from tests.parallel.layout_parity import _record_grads, _rel
from tests.parallel.test_moe_pp import (
    STEPS,
    _biases,
    _expected,
    _full_state,
    _reference,
    _trainer,
    global_batch,
    preset_cfg,
)

PRESET = "deepseek_v3_debug"
BASE = {"parallel.pp": 2, "parallel.ep": 2, "parallel.pp_schedule": "dualpipev"}
MODES = ({"parallel.pp_overlap": "false"}, {"parallel.pp_overlap": "true"},
         {"parallel.pp_overlap": "true", "parallel.moe_shared_overlap": True})


class _Threads(RuntimeObserver):
    """Per action: (kind, on the main thread?, start, end) in ``time.perf_counter`` seconds."""

    def __init__(self):
        self.log: list[tuple] = []
        self._t0: dict = {}

    def on_action_start(self, a) -> None:
        self._t0[a] = time.perf_counter()

    def on_action_end(self, a) -> None:
        main = threading.current_thread() is threading.main_thread()
        self.log.append((a.kind, main, self._t0.pop(a), time.perf_counter()))


def _train(over: dict, world: int) -> dict:
    cfg = preset_cfg(PRESET, world, {**BASE, **over})
    tr, mesh = _trainer(cfg, world)
    threads = _Threads()
    tr.pipeline.runtime.observers.append(threads)
    grads: list = []
    _record_grads(tr, grads)
    dp = mesh.group("dp")
    local = cfg.training.global_batch_size // dp.size
    sl = slice(dp.rank * local, (dp.rank + 1) * local)
    steps = []
    for step in range(STEPS):
        inputs, labels = global_batch(step)
        steps.append(tr.step(inputs[sl], labels[sl]))
    ep = mesh.group("ep")
    return {"tr": tr, "steps": steps, "grads": grads, "state": _full_state(tr), "biases": _biases(tr),
            "overlap": tr.pipeline.runtime.overlap, "log": threads.log,
            "pairs": len(tr.pipeline.runtime.schedule(tr.pipeline.m).pairs[mesh.group("pp").rank]),
            "twin": ep.bwd is not None and ep.bwd.pg is not None and ep.bwd.pg is not ep.pg}


def _overlapping_pairs(log: list[tuple]) -> int:
    """Pairs whose worker-thread B interval intersects the main-thread F logged right before it."""
    n = 0
    for k, (kind, main, t0, t1) in enumerate(log):
        if kind == "B" and not main:
            f = next(e for e in reversed(log[:k]) if e[0] == "F" and e[1])
            n += f[2] < t1 and t0 < f[3]
    return n


def _rank(rank: int, world: int) -> list[dict]:
    torch.set_num_threads(1)
    runs = [_train(over, world) for over in MODES]
    ref = _reference(PRESET, False, preset_cfg(PRESET, world, BASE).training.global_batch_size)
    out = []
    for over, run in zip(MODES, runs):
        base = runs[0]
        # the shared-expert overlap counts its all-to-all bytes its own way, pp_overlap or not
        skip = {"moe_a2a_bytes"} if over.get("parallel.moe_shared_overlap") else set()
        diff = sorted({k for d, b in zip(run["steps"], base["steps"]) for k in b if d.get(k) != b[k]} - skip)
        same = not diff
        same_grads = all(torch.equal(g[n], b[n]) for g, b in zip(run["grads"], base["grads"]) for n in b)
        same_state = all(torch.equal(run["state"][n], v) for n, v in base["state"].items())
        same_bias = all(torch.equal(run["biases"][n], v) for n, v in base["biases"].items())
        err = 0.0
        for d, r in zip(run["steps"], ref["steps"]):
            err = max(err, abs(d["loss"] - r["loss"]) / abs(r["loss"]),
                      abs(d["grad_norm"] - r["grad_norm"]) / r["grad_norm"])
        ep = run["tr"].mesh.group("ep")
        for step, got in enumerate(run["grads"]):
            for n, g in got.items():
                full = _expected(run["tr"], n, ref["grads"][step][n])
                if g.shape != full.shape:  # an expert weight: this ep rank's block of experts
                    full = full.chunk(ep.size)[ep.rank]
                err = max(err, _rel(g, full))
        for n, v in run["state"].items():
            err = max(err, _rel(v, ref["params"][n]))
        worker_b = sum(1 for kind, main, _, _ in run["log"] if kind == "B" and not main)
        out.append({"over": over, "diff": diff, "bitwise": (same, same_grads, same_state, same_bias), "err": err,
                    "overlap": run["overlap"], "worker_b": worker_b, "pairs": run["pairs"],
                    "overlapping": _overlapping_pairs(run["log"]), "twin": run["twin"],
                    "n_grads": len(run["grads"]), "n_bias": len(run["biases"])})
    return out


@pytest.mark.timeout(600)
def test_dualpipev_overlap_bitwise_equal_to_sequential_pp2_ep2():
    res = run_ranks(_rank, 4, timeout_s=600)
    for per_rank in res:
        for r in per_rank:
            assert r["bitwise"] == (True, True, True, True), r
            assert r["err"] < 1e-6, r
            assert r["twin"], r
            assert r["n_grads"] == STEPS, r
        off, on, on_shared = per_rank
        assert not off["overlap"] and off["worker_b"] == 0, off
        for r in (on, on_shared):  # every pair's B ran on the worker thread, every step
            assert r["overlap"] and r["pairs"] > 0 and r["worker_b"] == r["pairs"] * STEPS, r
    assert sum(r["overlapping"] for per_rank in res for r in per_rank[1:]) > 0  # the threads did overlap
    assert sum(r["n_bias"] for r in (res[0][0], res[2][0])) == 4  # pp stage 0 / 1: each MoE layer's bias once


def test_pp_overlap_rule():
    """``true`` needs every condition (the error names the one that fails); ``auto`` falls back to
    sequential pairs; unknown values are rejected."""
    from ndtrain.parallel.pp.rules import check_overlap, resolve_overlap

    ok = {"pp": 2, "pp_schedule": "dualpipev"}
    assert resolve_overlap("auto", **ok) and resolve_overlap(True, **ok)  # YAML true arrives as "True"
    assert not resolve_overlap("false", **ok) and not resolve_overlap("auto", 2, "1f1b")
    assert not resolve_overlap("auto", **ok, zero_stage=3) and not resolve_overlap("auto", **ok, device="cuda")
    for bad, needle in (({"tp": 2}, "tp (2) == 1"), ({"cp": 2}, "cp (2) == 1"), ({"zero_stage": 3}, "zero_stage (3)"),
                        ({"activation_checkpoint": "full"}, "activation_checkpoint=none"),
                        ({"compiled": True}, "training.compile=false"), ({"device": "cuda"}, "training.device=cpu"),
                        ({"pp_schedule": "1f1b"}, "pp_schedule=dualpipev")):
        with pytest.raises(ConfigError, match="pp_overlap=true needs " + needle.replace("(", r"\(").replace(")", r"\)")):
            check_overlap("true", **{**ok, **bad})
    with pytest.raises(ConfigError, match="must be auto|true|false"):
        check_overlap("sometimes", **ok)
    preset_cfg(PRESET, 4, {**BASE, "parallel.pp_overlap": "true", "parallel.zero_stage": 2})  # valid
    with pytest.raises(ConfigError, match="zero_stage"):
        preset_cfg(PRESET, 4, {**BASE, "parallel.pp_overlap": "true", "parallel.zero_stage": 3})
