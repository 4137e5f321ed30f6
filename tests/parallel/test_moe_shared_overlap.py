"""``parallel.moe_shared_overlap`` (Megatron-Core's ``moe_shared_expert_overlap``): the shared
experts run while the expert-parallel dispatch all-to-all is in flight
(``ndtrain.parallel.ep.overlap``).

The overlapped path does the same float64 ops on the same tensors, only in another order, so the
contract is *bitwise* equality with the synchronous path: losses, step-0 gradients, final weights
and buffers, and the bytes on every mesh axis, per layout. Each layout trains twice on the same
ranks (overlap off, then on). A fault would show as: a buffer read before the all-to-all filled it
(garbage or stale rows: the loss differs at step 0), a missing or doubled reverse all-to-all in
backward (wrong or unsynchronised expert gradients, bytes differ), or the gradient of the layer
input summed in another order (last-bit differences in the gradients).

The model is ``tests/parallel/test_ep.py``'s (sigmoid group-limited top-2 routing, one shared
expert, Switch + sequence-wise + z losses, aux-loss-free bias), with the Qwen3-Next shared gate.
One 4-rank spawn runs every layout.
"""
from __future__ import annotations

import pytest
import torch

from ndtrain.config import ConfigError
from ndtrain.mesh import ParallelDims
from ndtrain.parallel.ep import layers as ep_layers
from ndtrain.parallel.ep import overlap
from ndtrain.train.loop import Trainer
from tests.dist_utils import run_ranks
from tests.parallel.test_ep_zero import full_state, moe_cfg, train

STEPS = 3
WORLD = 4
# (name, parallel config, activation checkpointing): ep borrows 2 of dp_shard's ranks
LAYOUTS = {
    "ep2": ({"dp_shard": 4, "ep": 2}, "none"),
    "ep2_zero3": ({"dp_shard": 4, "ep": 2, "zero_stage": 3}, "none"),
    "ep2_zero1_ac_full": ({"dp_shard": 4, "ep": 2, "zero_stage": 1}, "full"),
    "tp2_ep2_etp1_sp": ({"tp": 2, "ep": 2, "expert_tp": 1, "sequence_parallel": True}, "none"),
    "tp2_ep2_etp2": ({"tp": 2, "ep": 2, "expert_tp": 2}, "none"),
    "pp2_ep2_1f1b": ({"pp": 2, "dp_shard": 2, "ep": 2, "pp_microbatches": 2}, "none"),
}


def _build(par: dict, ac: str, on: bool) -> Trainer:
    cfg = moe_cfg(WORLD, 0, **par, moe_shared_overlap=on)
    cfg.model.moe_shared_gate = True  # the gate runs inside the overlapped closure too
    cfg.training.activation_checkpoint = ac
    return Trainer(cfg, ParallelDims.from_config(cfg.parallel, WORLD).build_mesh(), torch.device("cpu"))


class _Trace:
    """Records, per MoE forward, the order: dispatch started, shared closure ran, dispatch waited."""

    def __init__(self):
        self.events: list[str] = []
        start, wait, dispatch = overlap.start_all_to_all_v, overlap.PendingAllToAll.wait, ep_layers.dispatch_overlapped

        def traced_start(*a, **k):
            self.events.append("start")
            pending = start(*a, **k)
            if pending.work is not None:  # the blocking all-to-alls wait on the same class: not recorded
                pending.work.traced = True
            return pending

        def traced_wait(pending):
            if pending.work is not None and getattr(pending.work, "traced", False):
                self.events.append("wait")
            return wait(pending)

        def traced_dispatch(*a):
            side_fn = a[-1]

            def side():
                self.events.append("shared")
                return side_fn()
            return dispatch(*a[:-1], side)

        overlap.start_all_to_all_v = traced_start
        overlap.PendingAllToAll.wait = traced_wait
        ep_layers.dispatch_overlapped = traced_dispatch
        self._undo = (start, wait, dispatch)

    def close(self) -> None:
        overlap.start_all_to_all_v, overlap.PendingAllToAll.wait, ep_layers.dispatch_overlapped = self._undo


def _run(par: dict, ac: str, on: bool) -> tuple[dict, dict, list[str]]:
    trace = _Trace() if on else None
    try:
        tr = _build(par, ac, on)
        rec = train(tr, range(STEPS))
    finally:
        if trace is not None:
            trace.close()
    flags = [m.shared_overlap for m in tr.model.modules() if hasattr(m, "shared_overlap")]
    rec["flags"] = flags
    return rec, full_state(tr), trace.events if trace else []


def _rank(rank: int, world: int) -> dict:
    out = {}
    for name, (par, ac) in LAYOUTS.items():
        off, off_state, _ = _run(par, ac, False)
        on, on_state, events = _run(par, ac, True)
        out[name] = {
            "flags": (off["flags"], on["flags"]),
            "loss": on["loss"] == off["loss"] and on["aux"] == off["aux"] and on["gn"] == off["gn"],
            "grads": sorted(n for n, g in off["grads"].items() if not torch.equal(g, on["grads"][n])),
            "state": sorted(n for n, t in off_state.items() if not torch.equal(t, on_state[n])),
            "bytes": (off["bytes"], on["bytes"]),
            "events": events,
            "n_grads": len(off["grads"]),
        }
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_rank, WORLD, timeout_s=300)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_shared_overlap_is_bitwise_the_synchronous_path(results, layout):
    """Overlap on vs off, same layout and ranks: bitwise equal losses, aux losses, grad norms,
    step-0 gradients, final weights and buffers and per-axis bytes; and the shared closure really
    ran between the start and the wait of every MoE layer's dispatch."""
    for r in results:
        v = r[layout]
        off_flags, on_flags = v["flags"]
        assert not any(off_flags) and on_flags and all(on_flags), v["flags"]
        assert v["loss"], layout
        assert v["n_grads"] > 0 and v["grads"] == [], v["grads"]
        assert v["state"] == [], v["state"]
        assert v["bytes"][0] == v["bytes"][1]
        assert v["bytes"][0].get("ep", 0) > 0
        ev = v["events"]
        # every training forward of each MoE layer a rank holds: 2 layers, or under pp 1 layer x 2
        # microbatches; AC full runs each once more in the recompute
        per_step = 2 * (2 if LAYOUTS[layout][1] == "full" else 1)
        assert len(ev) == 3 * per_step * STEPS, (len(ev), ev[:6])
        assert ev == ["start", "shared", "wait"] * (len(ev) // 3), ev[:9]


def test_shared_overlap_rule():
    """The rule names the key: ep == 1, or no shared experts, is rejected; ep2 with one is fine."""
    with pytest.raises(ConfigError, match="moe_shared_overlap=true needs ep > 1"):
        moe_cfg(WORLD, 0, dp_shard=4, moe_shared_overlap=True)
    cfg = moe_cfg(WORLD, 0, dp_shard=4, ep=2, moe_shared_overlap=True)
    assert cfg.parallel.moe_shared_overlap
    from ndtrain.config import validate

    cfg.model.moe_shared_experts = 0
    with pytest.raises(ConfigError, match="model.moe_shared_experts > 0"):
        validate(cfg, WORLD)
