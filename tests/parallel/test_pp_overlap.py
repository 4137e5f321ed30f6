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

The same spawn trains the config under 1F1B too (no B / W split; within 1e-6 of the single process):
the expert all-to-all bytes per step (``moe_a2a_bytes`` and the ``ep`` axis counter) must be EQUAL
under 1F1B and all three DualPipeV modes. DualPipeV's W pass differentiates the experts' weights
from their local grouped-GEMM output (``ExpertParallelExperts.weight_grad_output``); from the layer
output it would repeat the combine's backward all-to-all that B already ran (+25% bytes), and the
shared-expert overlap's tuple output used to escape the W deferral altogether. A spy on the W pass
checks that every DualPipeV mode defers the expert weights to W, from a tensor that is not an
all-to-all's output.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

from ndtrain.errors import ConfigError
from ndtrain.parallel.pp.observe import RuntimeObserver
from tests.dist_utils import run_ranks
from tests.parallel.layout_parity import _record_grads
from tests.parallel.test_moe_pp import (
    STEPS,
    _biases,
    _check,
    _expected,
    _full_state,
    _reference,
    _trainer,
    global_batch,
    preset_cfg,
)
from tests.parallel.test_moe_pp import (
    _rank as _layouts_rank,
)
from tests.utils import rel_err

PRESET = "deepseek_v3_debug"
BASE = {"parallel.pp": 2, "parallel.ep": 2, "parallel.pp_schedule": "dualpipev"}
MODES = ({"parallel.pp_overlap": "false"}, {"parallel.pp_overlap": "true"},
         {"parallel.pp_overlap": "true", "parallel.moe_shared_overlap": True})
ONE_F_ONE_B = {"parallel.pp_schedule": "1f1b", "parallel.pp_overlap": "false"}


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


class _WSpy:
    """Wraps the runtime's W pass: counts, over a run, the expert-parallel layers whose weights W
    differentiates (and those whose recorded tensor is an all-to-all's output), and the expert
    weights B differentiated directly instead."""

    def __init__(self):
        from ndtrain.parallel.pp import runtime

        self.module, self.inner = runtime, runtime.accumulate_weight_grads
        self.deferred = self.from_a2a = self.direct = 0
        runtime.accumulate_weight_grads = self

    def __call__(self, wgrads, direct=None, **kw):
        from ndtrain.optim import SHARD_AXES_ATTR
        from ndtrain.parallel.ep.layers import ExpertParallelExperts

        for (mod, y), g in wgrads:
            if isinstance(mod, ExpertParallelExperts) and g is not None:
                self.deferred += 1
                self.from_a2a += "AllToAll" in type(y.grad_fn).__name__
        self.direct += sum(1 for q, g in direct or [] if g is not None and "ep" in getattr(q, SHARD_AXES_ATTR, ()))
        return self.inner(wgrads, direct, **kw)

    def close(self) -> None:
        self.module.accumulate_weight_grads = self.inner


def _train(over: dict, world: int) -> dict:
    from ndtrain.parallel.ep.layers import ExpertParallelExperts

    cfg = preset_cfg(PRESET, world, {**BASE, **over})
    tr, mesh = _trainer(cfg, world)
    threads, spy = _Threads(), _WSpy()
    tr.pipeline.runtime.observers.append(threads)
    grads: list = []
    _record_grads(tr, grads)
    dp = mesh.group("dp")
    local = cfg.training.global_batch_size // dp.size
    sl = slice(dp.rank * local, (dp.rank + 1) * local)
    steps, ep_bytes = [], []
    mesh.reset_stats()
    try:
        for step in range(STEPS):
            inputs, labels = global_batch(step)
            steps.append(tr.step(inputs[sl], labels[sl]))
            ep_bytes.append(mesh.reset_stats().get("ep", 0.0))
    finally:
        spy.close()
    experts = [m for m in tr.model.modules() if isinstance(m, ExpertParallelExperts)]
    ep, pairs = mesh.group("ep"), tr.pipeline.runtime.schedule(tr.pipeline.m).pairs  # [] unless DualPipeV
    return {"tr": tr, "steps": steps, "grads": grads, "state": _full_state(tr), "biases": _biases(tr),
            "overlap": tr.pipeline.runtime.overlap, "log": threads.log,
            "pairs": len(pairs[mesh.group("pp").rank]) if pairs else 0,
            "twin": ep.bwd is not None and ep.bwd.pg is not None and ep.bwd.pg is not ep.pg,
            "a2a": [d["moe_a2a_bytes"] for d in steps], "ep_bytes": ep_bytes,
            "w": (spy.deferred, spy.from_a2a, spy.direct), "n_experts": len(experts), "m": tr.pipeline.m,
            "keep": {m.keep_weight_grad_output for m in experts},
            "left": sum(m.weight_grad_output is not None for m in experts)}


def _ref_err(run: dict, ref: dict) -> float:
    """Max relative error of losses, gradient norms, gradients and final parameters vs the reference."""
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
            err = max(err, rel_err(g, full))
    for n, v in run["state"].items():
        err = max(err, rel_err(v, ref["params"][n]))
    return err


def _bytes(run: dict) -> dict:
    return {k: run[k] for k in ("a2a", "ep_bytes", "w", "n_experts", "m", "keep", "left")}


def _overlapping_pairs(log: list[tuple]) -> int:
    """Pairs whose worker-thread B interval intersects the main-thread F logged right before it."""
    n = 0
    for k, (kind, main, t0, t1) in enumerate(log):
        if kind == "B" and not main:
            f = next(e for e in reversed(log[:k]) if e[0] == "F" and e[1])
            n += f[2] < t1 and t0 < f[3]
    return n


def _rank(rank: int, world: int) -> tuple[dict, list[dict]]:
    torch.set_num_threads(1)
    runs = [_train(over, world) for over in MODES]
    one_f_one_b = _train(ONE_F_ONE_B, world)
    ref = _reference(PRESET, False, preset_cfg(PRESET, world, BASE).training.global_batch_size)
    out = []
    base = runs[0]
    for over, run in zip(MODES, runs):
        diff = sorted({k for d, b in zip(run["steps"], base["steps"]) for k in b if d.get(k) != b[k]})
        same = not diff
        same_grads = all(torch.equal(g[n], b[n]) for g, b in zip(run["grads"], base["grads"]) for n in b)
        same_state = all(torch.equal(run["state"][n], v) for n, v in base["state"].items())
        same_bias = all(torch.equal(run["biases"][n], v) for n, v in base["biases"].items())
        worker_b = sum(1 for kind, main, _, _ in run["log"] if kind == "B" and not main)
        out.append({"over": over, "diff": diff, "bitwise": (same, same_grads, same_state, same_bias),
                    "err": _ref_err(run, ref), "overlap": run["overlap"], "worker_b": worker_b,
                    "pairs": run["pairs"], "overlapping": _overlapping_pairs(run["log"]), "twin": run["twin"],
                    "n_grads": len(run["grads"]), "n_bias": len(run["biases"]), **_bytes(run)})
    return {"err": _ref_err(one_f_one_b, ref), **_bytes(one_f_one_b)}, out


@pytest.mark.slow  # costly on 2 cores; the same axis keeps a smaller default test
@pytest.mark.timeout(600)
def test_dualpipev_overlap_bitwise_equal_to_sequential_pp2_ep2():
    res = run_ranks(_rank, 4, timeout_s=600)
    for one_f_one_b, per_rank in res:
        assert one_f_one_b["err"] < 1e-6, one_f_one_b
        assert one_f_one_b["w"] == (0, 0, 0) and one_f_one_b["keep"] == {False}, one_f_one_b  # no split: no hook
        assert one_f_one_b["n_experts"] > 0 and min(one_f_one_b["a2a"]) > 0, one_f_one_b
        for r in per_rank:
            assert r["bitwise"] == (True, True, True, True), r
            assert r["err"] < 1e-6, r
            assert r["twin"], r
            assert r["n_grads"] == STEPS, r
            assert r["a2a"] == one_f_one_b["a2a"], (r, one_f_one_b)  # summed over stages: W repeats none
            # the same B / W split in every mode: each expert layer's weights deferred to W once per
            # microbatch, from the local GEMM output; none differentiated directly in B
            deferred, from_a2a, direct = r["w"]
            assert deferred == r["n_experts"] * r["m"] * STEPS > 0 and from_a2a == 0 and direct == 0, r
            assert r["keep"] == {True} and r["left"] == 0, r  # no activation kept past its forward
        off, on, on_shared = per_rank
        assert off["w"] == on["w"] == on_shared["w"], per_rank
        assert not off["overlap"] and off["worker_b"] == 0, off
        for r in (on, on_shared):  # every pair's B ran on the worker thread, every step
            assert r["overlap"] and r["pairs"] > 0 and r["worker_b"] == r["pairs"] * STEPS, r
    # the ep axis counter is per rank, and the V puts other stages on a rank than 1F1B: sum the ranks
    by_mode = zip(*((one_f_one_b, *per_rank) for one_f_one_b, per_rank in res))  # per mode: the ranks' runs
    ep_total = [[sum(x) for x in zip(*(run["ep_bytes"] for run in ranks))] for ranks in by_mode]
    assert ep_total[0] == ep_total[1] == ep_total[2] == ep_total[3] and min(ep_total[0]) > 0, ep_total
    assert sum(r["overlapping"] for _, per_rank in res for r in per_rank[1:]) > 0  # the threads did overlap
    assert sum(r["n_bias"] for r in (res[0][1][0], res[2][1][0])) == 4  # pp stage 0 / 1: each MoE layer's bias once


# ZeRO-3 shards the experts over edp (2 here): their W pass differentiates the local GEMM output
# inside ``gathered`` (``split_backward.reads_parameters``: w1 -> w2 chain), re-gathering the units
# freed after the forward; G = 16 keeps 2 pp = 4 microbatches per dp rank (DualPipeV's minimum)
EP_ZERO3 = {"parallel.pp": 2, "parallel.ep": 2, "parallel.zero_stage": 3, "training.global_batch_size": 16}
ZERO3 = ((PRESET, {**EP_ZERO3, "parallel.pp_schedule": "zero_bubble"}),
         (PRESET, {**EP_ZERO3, "parallel.pp_schedule": "dualpipev"}))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_split_backward_pp2_ep2_edp2_zero3_8_ranks():
    """ZB-H1 and DualPipeV (sequential pairs: ZeRO-3 blocks the overlap) on pp2 x ep2 x edp2 with
    ZeRO-3, 8 processes, within 1e-6 of the single process (world ranks 0 / 4: pp stage 0 / 1).
    ~50 s on a 2-core machine."""
    _check(run_ranks(_layouts_rank, 8, ZERO3, timeout_s=900), ZERO3, 4)


def test_pp_overlap_rule():
    """``true`` needs every condition (the error names the one that fails); ``auto`` falls back to
    sequential pairs; unknown values are rejected."""
    from ndtrain.parallel.pp.rules import check_overlap, resolve_overlap

    ok = {"pp": 2, "pp_schedule": "dualpipev"}
    assert resolve_overlap("auto", **ok) and resolve_overlap(True, **ok)  # YAML true arrives as "True"
    assert not resolve_overlap("false", **ok) and not resolve_overlap("auto", 2, "1f1b")
    assert not resolve_overlap("auto", **ok, zero_stage=3) and not resolve_overlap("auto", **ok, device="cuda")
    # a dense pair (no expert all-to-all to hide) runs sequentially under auto, overlapped only when asked
    assert not resolve_overlap("auto", **ok, all_to_all=False) and resolve_overlap("true", **ok, all_to_all=False)
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
