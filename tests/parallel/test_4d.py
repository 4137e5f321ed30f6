"""Pipeline parallel composed with data (DDP, ZeRO-1/2/3, HSDP), tensor and context parallel on one
mesh, and PP checkpoints resharded across pipeline degrees.

Reference: the single-process ``Trainer`` on the whole global batch (``tests/parallel/test_pp.py``'s
tiny 8-layer model and uneven label masks), 10 steps, float64, clipping active. Compared per step:
the loss and the gradient norm before clipping (1e-6 relative, the issue's contract; the layouts
only reorder floating-point sums), and at the end every parameter the rank holds (layouts without
tensor parallel; TP shards are covered by the per-step norms and losses).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from ndtrain.checkpoint import dcp as ckpt
from ndtrain.config import validate
from ndtrain.mesh import ParallelDims
from ndtrain.train.loop import Trainer
from tests.dist_utils import run_ranks
from tests.parallel.test_pp import STEPS, global_batch, param_diff, pp_cfg, reference


def _layout(rank: int, world: int, layouts: list, save_to: str | None = None) -> dict:
    refs = {tie: reference(tie) for tie in {lay[-1] for lay in layouts}}
    out = {}
    for sched, m, v, par, tie in layouts:
        cfg = pp_cfg(2, sched, m, v, tie, **par)
        validate(cfg, world)
        dims = ParallelDims.from_config(cfg.parallel, world)
        mesh = dims.build_mesh()
        tr = Trainer(cfg, mesh, torch.device("cpu"))
        ref = refs[tie]
        dp, dp_rank = dims.dp, mesh.group("dp").rank
        local = global_batch(0)[0].shape[0] // dp
        errs = []
        for s in range(STEPS):
            x, y = global_batch(s)
            sl = slice(dp_rank * local, (dp_rank + 1) * local)
            mesh.reset_stats()
            d = tr.step(x[sl], y[sl])
            sent = mesh.reset_stats()
            errs.append(max(abs(d["loss"] - ref["loss"][s]) / ref["loss"][s],
                            abs(d["grad_norm"] - ref["gn"][s]) / ref["gn"][s]))
        diff = 0.0
        if dims.tp == 1 and cfg.parallel.zero_stage == 3:  # the model's params are freed shards
            from torch.distributed.tensor import DTensor

            sd = tr.dp.model_state_dict()  # {fqn: DTensor over dp_shard_cp}, global shapes
            full = {n: (t.full_tensor() if isinstance(t, DTensor) else t) for n, t in sorted(sd.items())}
            diff = max((full[n] - ref["params"][n]).abs().max().item() for n in full)
        elif dims.tp == 1:
            diff = param_diff(tr.model, ref["params"])
        sp = " sp" if cfg.parallel.sequence_parallel else ""
        out[f"{dims} {sched} zero{cfg.parallel.zero_stage}{sp}"] = {"err": max(errs), "param_diff": diff,
                                                               "bytes": sent}
        if save_to is not None and not out.get("reshard_names"):  # the first layout: save it,
            # load it into pp4 on the same ranks (names are the full model's, shapes global)
            ckpt.save_checkpoint(Path(save_to), STEPS, tr.tensor_state(), {"step": STEPS})
            cfg4 = pp_cfg(4, "1f1b", 2, 1, tie)
            validate(cfg4, world)
            tr4 = Trainer(cfg4, ParallelDims.from_config(cfg4.parallel, world).build_mesh(),
                          torch.device("cpu"))
            state = tr4.tensor_state()
            ckpt.load_checkpoint(ckpt.latest_checkpoint(Path(save_to)), state)
            tr4.load_tensor_state(state)
            names = dict(tr4.model.named_parameters())
            out["reshard_param_diff"] = param_diff(tr4.model, ref["params"])
            alias = {n: "tok_embeddings.weight" if n == "output.weight" and tie else n for n in names}
            out["reshard_moment_diff"] = max((tr4.optimizer.state[q]["exp_avg"] - ref["exp_avg"][alias[n]])
                                             .abs().max().item() for n, q in names.items())
            out["reshard_names"] = sorted(names)
            out["reshard_groups"] = ([(g["lr"], g["weight_decay"]) for g in tr4.optimizer.param_groups]
                                     == [(g["lr"], g["weight_decay"]) for g in tr.optimizer.param_groups])
    return out


def _check(res: list) -> None:
    for r in res:
        for key, e in r.items():
            if isinstance(e, dict):
                assert e["err"] < 1e-6 and e["param_diff"] < 1e-9, (key, e)


def test_pp2_with_dp_tp_cp_zero_on_4_ranks():
    """pp2 x dp2 with DDP (tied embeddings; its checkpoint resharded to pp4), ZeRO-1, ZeRO-2 and
    ZeRO-3 / FSDP; pp2 x tp2 (vocab-parallel head on the last stage), also with sequence parallel
    (stages exchange sequence shards); pp2 x cp2 (ring attention inside each stage). Every schedule
    appears at least once."""
    layouts = [("1f1b", 2, 1, {}, True),
               ("gpipe", 2, 1, {"zero_stage": 1}, True),
               ("zero_bubble", 2, 1, {"zero_stage": 2}, True),
               ("1f1b", 2, 1, {"zero_stage": 2}, True),
               ("interleaved", 3, 2, {"zero_stage": 3}, False),
               ("interleaved", 3, 2, {"tp": 2}, True),
               ("zero_bubble", 3, 1, {"tp": 2, "sequence_parallel": True}, True),
               ("zero_bubble", 3, 1, {"cp": 2}, True)]
    with tempfile.TemporaryDirectory() as tmp:
        res = run_ranks(_layout, 4, layouts, tmp, timeout_s=280)
    _check(res)
    assert sum(isinstance(e, dict) for e in res[0].values()) == len(layouts)
    # ZB-H1's W passes accumulate a chunk's weight grads in one backward, so ZeRO-2 reduces each
    # microbatch once, exactly as under 1F1B (not once per module)
    zb, ofob = (res[0][f"pp2 x dp_shard2 (world 4) {s} zero2"]["bytes"] for s in ("zero_bubble", "1f1b"))
    assert zb == ofob and zb["dp_shard_cp"] > 0
    for r in res:  # a pp2 x dp2 checkpoint loads into pp4: the reference's weights and moments
        assert r["reshard_param_diff"] < 1e-9 and r["reshard_moment_diff"] < 1e-12, r
        assert r["reshard_groups"], "optimizer hyperparameters (lr, decay groups) must load"
    assert len({n for r in res for n in r["reshard_names"]}) == 8 * 9 + 3


@pytest.mark.slow
@pytest.mark.parametrize("par", [{"dp_shard": 2, "tp": 2, "zero_stage": 3}, {"cp": 2, "tp": 2, "zero_stage": 3},
                                 {"dp_replicate": 2, "dp_shard": 2, "zero_stage": 3}],
                         ids=["pp2xdp2xtp2-fsdp", "pp2xcp2xtp2-fsdp", "pp2xhsdp2x2"])
def test_4d_layouts_on_8_ranks(par):
    """The issue's 4-D layouts on 8 processes with FSDP (ZeRO-3; over dp_shard x cp), and HSDP;
    1F1B with uneven microbatches where the local batch allows, untied embeddings."""
    m = 3 if par.get("dp_shard", 1) * par.get("dp_replicate", 1) == 1 else 2
    res = run_ranks(_layout, 8, [("1f1b", m, 1, par, False)], timeout_s=400)
    _check(res)
