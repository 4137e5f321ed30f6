"""Checkpoints hold every tensor whole under its global name, and ranks with
different local batch sizes fail together with one clear error.

Round trip: each layout trains 2 steps on the same global batches as one plain process, saves a
checkpoint, and a fresh trainer of the same layout loads it back. Then, in the test process (no
process group), the checkpoint is loaded into the single-process trainer's ``tensor_state()``: DCP
raises on any missing name or global-shape mismatch (the old bug saved one tp rank's [V/2, C] slice
of the tied head's moments under ``tok_embeddings.weight``), and every model / optimizer tensor is
compared with the single-process run's. Tolerance: float64, the layouts differ only in summation
order (~1e-15 relative per op); 1e-8 relative (plus 1e-12 absolute for moments near zero) is far
below what a wrong slice, a wrong name or a lost step would give (the update moves weights ~1e-3).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ndtrain.checkpoint import dcp as ckpt
from ndtrain.config import validate
from ndtrain.mesh import ParallelDims
from ndtrain.train.loop import Trainer
from tests.dist_utils import run_ranks
from tests.parallel.test_pp import global_batch, pp_cfg

STEPS = 2
LAYOUTS = {  # name: (tie_embeddings, parallel overrides) on 4 ranks
    "tp2_pp2_tied": (True, {"pp": 2, "tp": 2}),
    "zero3_tied": (True, {"pp": 1, "zero_stage": 3}),
    "tp2_zero1": (False, {"pp": 1, "tp": 2, "zero_stage": 1}),
    "pp2_dp2": (False, {"pp": 2}),
}


def _flat(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _trainer(tie: bool, par: dict, world: int) -> tuple[Trainer, int, int]:
    cfg = pp_cfg(par.get("pp", 1), tie=tie, **{k: v for k, v in par.items() if k != "pp"})
    validate(cfg, world)
    dims = ParallelDims.from_config(cfg.parallel, world)
    mesh = dims.build_mesh()
    return Trainer(cfg, mesh, torch.device("cpu")), dims.dp, mesh.group("dp").rank


def _save_and_reload(rank: int, world: int, tmp: str) -> dict:
    out = {}
    for name, (tie, par) in LAYOUTS.items():
        tr, dp, dp_rank = _trainer(tie, par, world)
        for s in range(STEPS):
            x, y = global_batch(s)
            local = x.shape[0] // dp
            sl = slice(dp_rank * local, (dp_rank + 1) * local)
            tr.step(x[sl], y[sl])
        saved = {k: _full(v).clone() for k, v in _flat(tr.tensor_state()).items() if torch.is_tensor(v)}
        path = ckpt.save_checkpoint(Path(tmp) / name, STEPS, tr.tensor_state(), {"step": STEPS})
        fresh, _, _ = _trainer(tie, par, world)
        state = fresh.tensor_state()
        ckpt.load_checkpoint(path, state)
        fresh.load_tensor_state(state)
        back = {k: _full(v) for k, v in _flat(fresh.tensor_state()).items() if torch.is_tensor(v)}
        out[name] = max(((back[k] - v).abs().max().item() for k, v in saved.items()), default=-1.0)
        out[name + "_keys"] = sorted(saved) == sorted(back)
    return out


def test_every_saved_tensor_is_whole_under_its_global_name(tmp_path):
    torch.set_num_threads(1)
    results = run_ranks(_save_and_reload, 4, str(tmp_path), timeout_s=600)
    for name in LAYOUTS:  # the layout reloads its own checkpoint exactly
        assert all(r[name + "_keys"] and r[name] == 0.0 for r in results), (name, results)
    for name, (tie, _) in LAYOUTS.items():
        ref = Trainer(pp_cfg(1, tie=tie), ParallelDims(world_size=1).build_mesh(), torch.device("cpu"))
        for s in range(STEPS):
            ref.step(*global_batch(s))
        want = {k: v for k, v in _flat(ref.tensor_state()).items() if torch.is_tensor(v)}
        fresh = Trainer(pp_cfg(1, tie=tie), ParallelDims(world_size=1).build_mesh(), torch.device("cpu"))
        state = fresh.tensor_state()
        ckpt.load_tensors(tmp_path / name / f"step_{STEPS:08d}", state)  # raises on a missing name / shape
        got = {k: v for k, v in _flat(state).items() if torch.is_tensor(v)}
        assert got.keys() == want.keys() and any(".exp_avg_sq" in k for k in got)
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=1e-8, atol=1e-12, msg=f"{name}: {key}")


def _uneven(rank: int, world: int, layouts: list) -> list[str]:
    """Rank-dependent local batch sizes (4 vs 2 sequences per dp rank): every rank must raise."""
    msgs = []
    for par in layouts:
        tr, _, dp_rank = _trainer(False, par, world)
        x, y = global_batch(0)
        n = 4 if dp_rank == 0 else 2
        with pytest.raises(ValueError) as err:
            tr.step(x[:n], y[:n])
        msgs.append(str(err.value))
        tr.step(x[:3], y[:3])  # the group is still usable: an even (short) batch trains
    return msgs


@pytest.mark.parametrize("world,layouts", [
    (2, [{"zero_stage": 0}, {"zero_stage": 1}, {"zero_stage": 2}, {"zero_stage": 3}]),
    (4, [{"pp": 2}]),
])
def test_uneven_local_batches_raise_the_same_error_on_every_rank(world, layouts):
    torch.set_num_threads(1)
    results = run_ranks(_uneven, world, layouts, timeout_s=300)  # a hang fails by timeout
    for msgs in results:
        assert msgs == results[0]
        assert len(msgs) == len(layouts)
        assert all("local batch sizes differ across the 2 data-parallel x cp ranks (6 sequences in all"
                   in m for m in msgs), msgs
