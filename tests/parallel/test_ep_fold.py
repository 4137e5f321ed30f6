"""The folded expert mesh (``ndtrain.mesh``: MoE Parallel Folding) against the single process.

One spawn of 4 gloo ranks runs every layout, each 10 float64 AdamW steps (clipping active), on
``test_moe_tp``'s shrunk ``moe_debug`` (8 experts, top-2, shared expert, Switch / sequence / z
losses, aux-loss-free bias, capacity dropping):

* ``tp2 x dp2`` with ``ep4`` (expert_tp 1): ep spans the tp ranks, without and with sequence
  parallel, and under ZeRO-1;
* ``dp4`` with ``expert_tp 2`` under tp 1 (edp 2), and ``ep2 x expert_tp2`` (edp 1).

Reference: the world-size-1 ``Trainer`` on the whole global batch (microbatches = the ranks'
local batches). Compared per step: loss, aux loss, grad norm, load metrics and every applied
gradient (this rank's ep block, its expert_tp / tp slice); at the end every parameter, the expert
biases (bitwise) and the checkpoint view (each tensor whole under its single-process name).
Tolerance 1e-8 relative: the layouts only reorder float64 sums (~1e-13); a token sent to the
wrong expert, a gradient summed over the wrong group or counted twice in the norm is O(1e-2) off.
Then a folded run saved after 5 steps resumes in one process and finishes equal to the
uninterrupted single-process run. The 8-rank run (slow): pp2 x tp2 x dp2, ep4, ZeRO-1.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ndtrain.config import ConfigError, validate
from ndtrain.mesh import ParallelDims
from ndtrain.parallel.ep.layers import EXPERT_SPLIT_DIMS
from ndtrain.parallel.tp.tensor_parallel import tp_local_slice, tp_specs
from tests.dist_utils import run_ranks
from tests.parallel.layout_parity import STEPS, G
from tests.parallel.test_moe_tp import METRICS, _cfg, _checkpoint_view, _reference, _train
from tests.utils import rel_err

TOL = 1e-8
LAYOUTS = {
    "tp2_ep4": {"tp": 2, "ep": 4},
    "tp2_ep4_sp": {"tp": 2, "ep": 4, "sequence_parallel": True},
    "tp2_ep4_zero1": {"tp": 2, "ep": 4, "zero_stage": 1},
    "etp2": {"expert_tp": 2},
    "ep2_etp2": {"ep": 2, "expert_tp": 2},
}
LAYOUTS8 = {"pp2_tp2_ep4_zero1": {"pp": 2, "tp": 2, "ep": 4, "zero_stage": 1}}
RESUME, STOP = ("tp2_ep4", "tp2_ep4_zero1"), 5


def _expected(tr, mesh, name: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of a reference tensor: its ep block of experts, its expert_tp slice of a
    folded expert weight, its tp slice of a tp-split one."""
    ep, etp = mesh.group("ep"), mesh.group("expert_tp")
    if ".experts." in name:
        if ep.size > 1:
            el = full.shape[0] // ep.size
            full = full[ep.rank * el:(ep.rank + 1) * el]
        if mesh.dims.folded and etp.size > 1:
            full = full.chunk(etp.size, EXPERT_SPLIT_DIMS[name.rsplit(".", 1)[1]])[etp.rank]
    return tp_local_slice(full, tp_specs(tr.model).get(name), mesh.group("tp"))


def _compare(run: dict, ref: dict) -> dict:
    tr, mesh = run["tr"], run["mesh"]
    out = {k: 0.0 for k in METRICS + ("grad", "param")}
    for d, r in zip(run["steps"], ref["steps"]):
        for k in METRICS:
            out[k] = max(out[k], abs(d[k] - r[k]) / max(abs(r[k]), 1e-30))
    zero = tr.cfg.parallel.zero_stage > 0  # its gradients are flat shards: checked through the norm
    for g, rg in zip(run["grads"] if not zero else [], ref["grads"]):
        for n, t in g.items():
            out["grad"] = max(out["grad"], rel_err(t, _expected(tr, mesh, n, rg[n])))
    for n, p in tr.model.named_parameters():
        out["param"] = max(out["param"], rel_err(p.detach(), _expected(tr, mesh, n, ref["params"][n])))
    biases = {n: b for n, b in tr.model.named_buffers() if n.endswith("expert_bias")}  # this stage's
    out["bias_equal"] = bool(biases) and all(torch.equal(b, ref["params"][n]) for n, b in biases.items())
    ref_params = ref["params"]
    if mesh.dims.pp > 1:  # a stage's checkpoint view holds its own layers (global names and shapes)
        mine = set(tr.dp.model_state_dict())
        ref_params = {n: v for n, v in ref_params.items() if n in mine}
    view = _checkpoint_view(tr, mesh, ref_params, not zero)
    out.update(view)
    out["groups"] = {a: mesh.group(a).size for a in ("ep", "expert_tp", "edp", "edp_shard")}
    out["a2a_bytes"] = {k: v for k, v in run["tp_bytes"].items() if k in ("ep", "expert_tp")}
    return out


def _rank(rank: int, world: int, layouts: dict, tmp: str | None) -> dict:
    from ndtrain.checkpoint import dcp as ckpt

    torch.set_num_threads(1)
    out, refs = {}, {}
    for name, par in layouts.items():
        run = _train(_cfg("moe_debug", world, **par), world)
        local = G // run["mesh"].dims.dp  # the reference's microbatches are the ranks' local batches
        if local not in refs:
            refs[local] = _reference("moe_debug", local)
        out[name] = _compare(run, refs[local])
        out[name]["folded"] = run["mesh"].dims.folded
        if name in RESUME and tmp is not None:
            first = _train_steps(_cfg("moe_debug", world, **par), world, STOP)
            meta = {"step": STOP, "scheduler": first.scheduler.state_dict()}
            ckpt.save_checkpoint(Path(tmp) / name, STOP, first.tensor_state(), meta)
    return out


def _train_steps(cfg, world: int, steps: int):
    """A trainer of ``cfg`` after ``steps`` of ``layout_parity``'s batches (this rank's dp slice)."""
    from ndtrain.train.loop import Trainer
    from tests.parallel.layout_parity import global_batch

    mesh = ParallelDims.from_config(cfg.parallel, world).build_mesh()
    tr = Trainer(cfg, mesh, torch.device("cpu"))
    dp = mesh.group("dp")
    local = G // dp.size
    for s in range(steps):
        tr.step(*(x[dp.rank * local:(dp.rank + 1) * local] for x in global_batch(s)))
    return tr


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fold")
    return run_ranks(_rank, 4, LAYOUTS, str(tmp), timeout_s=600), tmp


def _check(results: list, layouts: dict) -> None:
    for name in layouts:
        for r in (per_rank[name] for per_rank in results):
            for key in METRICS + ("grad", "param", "ckpt"):
                assert r[key] < TOL, (name, key, r[key])
            assert r["bias_equal"] and r["names"] and r["shapes"], (name, r)
            zero = layouts[name].get("zero_stage", 0)
            assert zero or r["roundtrip"] == 0.0, (name, r)  # ZeRO's: the DCP resume below
            assert r["folded"], name


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_folded_layout_matches_single_process(saved, layout):
    results, _ = saved
    _check(results, {layout: LAYOUTS[layout]})
    r = results[0][layout]
    par = LAYOUTS[layout]
    ep, etp = par.get("ep", 1), par.get("expert_tp", 1)
    assert r["groups"]["ep"] == ep and r["groups"]["expert_tp"] == etp
    assert r["groups"]["edp"] == 4 // (ep * etp)
    assert (r["a2a_bytes"].get("ep", 0) > 0) == (ep > 1), r["a2a_bytes"]
    assert (r["a2a_bytes"].get("expert_tp", 0) > 0) == (etp > 1), r["a2a_bytes"]


@pytest.mark.parametrize("layout", RESUME)
def test_folded_checkpoint_resumes_in_one_process(saved, layout):
    """tp2 x dp2 / ep4 (DDP, ZeRO-1) saved after 5 steps, loaded into one process, 5 more steps:
    equal to the uninterrupted single-process run (losses and parameters 1e-8)."""
    from ndtrain.checkpoint import dcp as ckpt
    from tests.parallel.layout_parity import global_batch

    _, tmp = saved
    whole = _train_steps(_cfg("moe_debug", 1, G // 2), 1, 0)
    want = [whole.step(*global_batch(s))["loss"] for s in range(STEPS)]
    one = _train_steps(_cfg("moe_debug", 1, G // 2), 1, 0)
    state = one.tensor_state()
    meta = ckpt.load_checkpoint(Path(tmp) / layout / f"step_{STOP:08d}", state)
    one.load_tensor_state(state)
    one.scheduler.load_state_dict(meta["scheduler"])
    one.step_count = meta["step"]
    got = [one.step(*global_batch(s))["loss"] for s in range(STOP, STEPS)]
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want[STOP:])) < TOL, (got, want[STOP:])
    ref = dict(whole.model.named_parameters())
    assert max(rel_err(p.detach(), ref[n].detach()) for n, p in one.model.named_parameters()) < TOL


@pytest.mark.slow
def test_folded_pp2_zero1_on_8_ranks():
    """pp2 x tp2 x dp2 with ep4 spanning tp and ZeRO-1, against the single process."""
    results = run_ranks(_rank, 8, LAYOUTS8, None, timeout_s=600)
    _check(results, LAYOUTS8)


def test_folded_mesh_rules():
    """The expert mesh's rules fail before any process starts, naming the rule."""
    cases = (({"ep": 8}, 4, r"ep\*expert_tp \(8\) does not divide the ranks of a pp stage"),
             ({"tp": 2, "ep": 4, "edp": 2}, 4, r"parallel.edp \(2\) != world_size / \(pp\*ep\*expert_tp\)"),
             ({"expert_tp": 2, "zero_stage": 1}, 4, r"needs parallel.zero_stage 0"),
             ({"expert_tp": 3}, 3, r"moe_ffn_hidden \(16\) is not divisible by expert_tp \(3\)"),
             ({"dp_replicate": 2, "dp_shard": 1, "tp": 2, "ep": 4}, 4, r"edp \(1\) is not divisible by dp_replicate"))
    for par, world, words in cases:
        with pytest.raises(ConfigError, match=words):
            validate(_cfg("moe_debug", None, **par), world)
    dims = ParallelDims.from_config(_cfg("moe_debug", 4, tp=2, ep=4).parallel, 4)
    assert dims.folded and dims.expert_degrees() == {"edp": 1, "ep": 4, "expert_tp": 1}
    legacy = ParallelDims.from_config(_cfg("moe_debug", 4, tp=2, ep=2).parallel, 4)
    assert not legacy.folded and legacy.expert_degrees() == {"edp": 2, "ep": 2, "expert_tp": 1}
