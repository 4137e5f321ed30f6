"""Uneven pipeline layouts (``parallel.pp_layout``) train exactly like one process and resume there.

One spawned group of 2 ranks runs a 5-block model under four layouts: 1F1B with the embedding alone
on stage 0 (``E|t*5,L``); interleaved pp2 x v2 with the embedding and the head each alone on a
virtual stage, Llama 3's end stages (``E|t*3|t*2|L``); DualPipeV with rank 0 holding the lone
embedding and the last block with the head (``E|t*2|t*2|t,L``); zero-bubble with a tied head
(``Et*4|t,L``); interleaved with an MTP depth beside the lone head (``E|t*3|t*2|mL``). Reference: the same model in one process on the whole batch. float64, 4 steps,
clipping active: the layouts only reorder sums (~1e-15), so losses and gradient norms must agree to
1e-8 relative and every parameter to 1e-9; a block on the wrong stage, a lost embedding gradient or
a wrong message would be off by far more (one step moves the weights by ~1e-3). The interleaved
run saves a checkpoint that the test process loads into one plain process: every tensor equals the
reference's, and the next step's loss is the uninterrupted run's.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ndtrain.checkpoint import dcp as ckpt
from ndtrain.config import Config, validate
from ndtrain.mesh import ParallelDims
from ndtrain.train.loop import Trainer
from tests.dist_utils import run_ranks
from tests.parallel.test_checkpoint_state import _flat  # nested state dict -> dotted names
from tests.parallel.test_pp import global_batch, param_diff
from tests.utils import tiny_config

N_LAYERS, STEPS = 5, 4
LAYOUTS = {  # name: (schedule, v, tie_embeddings, mtp_depth, layout)
    "1f1b": ("1f1b", 1, False, 0, "E|t*5,L"),
    "interleaved": ("interleaved", 2, False, 0, "E|t*3|t*2|L"),
    "dualpipev": ("dualpipev", 1, False, 0, "E|t*2|t*2|t,L"),
    "zero_bubble_tied": ("zero_bubble", 1, True, 0, "Et*4|t,L"),
    "interleaved_mtp": ("interleaved", 2, False, 1, "E|t*3|t*2|mL"),
}
BLOCKS = {  # blocks per rank under each layout (rank 0, rank 1)
    "1f1b": ([], ["0", "1", "2", "3", "4"]), "interleaved": (["3", "4"], ["0", "1", "2"]),
    "dualpipev": (["4"], ["0", "1", "2", "3"]), "zero_bubble_tied": (["0", "1", "2", "3"], ["4"]),
    "interleaved_mtp": (["3", "4"], ["0", "1", "2"]),
}


def cfg_of(pp: int, sched: str = "1f1b", v: int = 1, tie: bool = False, mtp: int = 0,
           layout: str = "") -> Config:
    return tiny_config({"model.vocab_size": 64, "model.dim": 32, "model.n_layers": N_LAYERS,
                        "model.tie_embeddings": tie, "model.mtp_depth": mtp, "data.seq_len": 8, "training.global_batch_size": 8,
                        "training.lr": 1e-3},
                       parallel={"pp": pp, "dp_shard": -1, "pp_schedule": sched, "pp_microbatches": 4 if pp > 1 else 0,
                                 "pp_virtual_stages": v, "pp_layout": layout})


def reference(tie: bool = False, mtp: int = 0) -> Trainer:
    return Trainer(cfg_of(1, tie=tie, mtp=mtp), ParallelDims(world_size=1).build_mesh(), torch.device("cpu"))


def _ref_run(tie: bool, mtp: int, steps: int) -> dict:
    ref = reference(tie, mtp)
    out = [ref.step(*global_batch(s)) for s in range(steps)]
    return {"loss": [o["loss"] for o in out], "gn": [o["grad_norm"] for o in out],
            "mtp": [o.get("mtp_loss", 0.0) for o in out],
            "params": {n: q.detach().clone() for n, q in ref.model.named_parameters()}}


def _layouts(rank: int, world: int, tmp: str) -> dict:
    refs = {(tie, mtp): _ref_run(tie, mtp, STEPS) for _, _, tie, mtp, _ in LAYOUTS.values()}
    mesh = ParallelDims(pp=world, world_size=world).build_mesh()
    out = {}
    for name, (sched, v, tie, mtp, layout) in LAYOUTS.items():
        cfg = cfg_of(world, sched, v, tie, mtp, layout)
        validate(cfg, world)
        tr = Trainer(cfg, mesh, torch.device("cpu"))
        ref, loss_err, gn_err = refs[(tie, mtp)], 0.0, 0.0
        for s in range(STEPS):
            d = tr.step(*global_batch(s))
            loss_err = max(loss_err, abs(d["loss"] - ref["loss"][s]) / ref["loss"][s],
                           abs(d.get("mtp_loss", 0.0) - ref["mtp"][s]) / max(ref["mtp"][s], 1e-30))
            gn_err = max(gn_err, abs(d["grad_norm"] - ref["gn"][s]) / ref["gn"][s])
        names = dict(tr.model.named_parameters())
        out[name] = {"loss_err": loss_err, "gn_err": gn_err, "param_diff": param_diff(tr.model, ref["params"]),
                     "blocks": sorted(tr.model.layers.keys()), "embedding": "tok_embeddings.weight" in names,
                     "head": "output.weight" in names, "mtp": any(n.startswith("mtp.") for n in names),
                     "gn0": ref["gn"][0], "mtp0": ref["mtp"][0]}
        if name == "interleaved":
            ckpt.save_checkpoint(Path(tmp) / name, STEPS, tr.tensor_state(), {"step": STEPS})
    return out


def _resume_in_one_process(tmp_path: Path) -> None:
    """The interleaved layout's checkpoint, loaded into one process: the reference's tensors after
    STEPS steps, and the next step's loss and gradient norm."""
    ref = reference()
    for s in range(STEPS):
        ref.step(*global_batch(s))
    want = {k: v.clone() for k, v in _flat(ref.tensor_state()).items() if torch.is_tensor(v)}
    fresh = reference()
    state = fresh.tensor_state()
    ckpt.load_tensors(tmp_path / "interleaved" / f"step_{STEPS:08d}", state)  # raises on a missing name
    fresh.load_tensor_state(state)
    got = {k: v for k, v in _flat(fresh.tensor_state()).items() if torch.is_tensor(v)}
    assert got.keys() == want.keys() and any(".exp_avg_sq" in k for k in got)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-8, atol=1e-12, msg=key)
    a, b = fresh.step(*global_batch(STEPS)), ref.step(*global_batch(STEPS))
    assert abs(a["loss"] - b["loss"]) <= 1e-8 * b["loss"] and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-8 * b["grad_norm"]


def test_uneven_layouts_match_one_process_and_resume_there(tmp_path):
    torch.set_num_threads(1)
    res = run_ranks(_layouts, 2, str(tmp_path), timeout_s=280)
    for name in LAYOUTS:
        for rank, r in enumerate(res):
            e = r[name]
            assert e["loss_err"] < 1e-8 and e["gn_err"] < 1e-8, (name, rank, e)
            assert e["param_diff"] < 1e-9, (name, rank, e)
            assert e["gn0"] > 10 * 0.05, "clipping must be active"
            assert e["blocks"] == BLOCKS[name][rank], (name, rank, e["blocks"])
        assert res[0][name]["embedding"] and res[1 - (name == "dualpipev")][name]["head"], name
    assert not res[0]["1f1b"]["head"] and not res[1]["1f1b"]["embedding"]
    assert res[1]["interleaved_mtp"]["mtp"] and not res[0]["interleaved_mtp"]["mtp"]
    assert res[0]["interleaved_mtp"]["mtp0"] > 0.0  # the MTP loss was compared (and is not zero)
    _resume_in_one_process(tmp_path)
