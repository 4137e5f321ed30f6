"""``training.mup_base_width``: hidden-matrix LRs scaled so one LR transfers across widths.

Measured on the first step (float64, no clipping, no decay, no warmup) of tiny models of width
W = 32, 64, 128 (ffn 2W) with base B = 32: the update of every hidden matrix is the unscaled run's
times exactly the rule's factor (Muon moonlight sqrt(B/W), AdamW B/W), other parameters' updates
are unchanged, and the update's spectral norm per unit LR is then (nearly) width-independent while
without the scaling it grows with W."""
from __future__ import annotations

import math

import pytest
import torch

from ndtrain.mesh import ParallelDims
from ndtrain.optim.mup import hidden_init_factor, hidden_lr_factor
from ndtrain.train.loop import Trainer
from tests.parallel import layout_parity as lp
from tests.utils import tiny_config

WIDTHS = (32, 64, 128)
BASE = 32
HIDDEN = ("layers.0.feed_forward.w1.weight", "layers.1.attention.wq.weight")


def _update(opt: str, width: int, base: int) -> dict[str, torch.Tensor]:
    cfg = tiny_config({"model.dim": width, "model.ffn_hidden": 2 * width, "training.optimizer": opt,
                       "training.mup_base_width": base, "training.weight_decay": 0.0,
                       "training.warmup_steps": 0, "training.grad_clip": 0.0}, world=1)
    tr = Trainer(cfg, ParallelDims(world_size=1).build_mesh(), torch.device("cpu"))
    ps = dict(tr.model.named_parameters())
    before = {n: p.detach().clone() for n, p in ps.items()}
    tr.step(*lp.global_batch(0))
    return {n: ps[n].detach() - before[n] for n in ps}


@pytest.fixture(scope="module")
def updates():
    """First-step updates with the LR rule alone: the init factor held at 1, so both runs of a width
    start from the same weights and differ only in their LRs."""
    from ndtrain.optim import mup

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mup, "hidden_init_factor", lambda width, base: 1.0)
        return {(o, w, b): _update(o, w, b) for o in ("muon", "adamw") for w in WIDTHS for b in (0, BASE)}


def test_factors():
    assert hidden_init_factor(128, 32) == 0.5 and hidden_init_factor(128, 0) == 1.0
    assert hidden_lr_factor("adamw", "moonlight", 256, 32) == 0.125
    assert hidden_lr_factor("muon", "moonlight", 128, 32) == 0.5
    assert hidden_lr_factor("muon", "original", 128, 32) == 1.0
    assert hidden_lr_factor("muon", "moonlight", 128, 0) == 1.0


@pytest.mark.parametrize("opt", ["muon", "adamw"])
def test_hidden_updates_scale_by_the_factor_and_the_rest_not(updates, opt):
    for w in WIDTHS[1:]:
        f = hidden_lr_factor(opt, "moonlight", w, BASE)
        assert f == (math.sqrt(BASE / w) if opt == "muon" else BASE / w)
        on, off = updates[(opt, w, BASE)], updates[(opt, w, 0)]
        for n in on:
            hidden = n.endswith(("wq.weight", "wk.weight", "wv.weight", "wo.weight", "w1.weight", "w2.weight",
                                 "w3.weight"))
            want = off[n] * (f if hidden else 1.0)
            assert torch.allclose(on[n], want, rtol=1e-12, atol=1e-16), (opt, w, n)  # atol: weights ~1e-2, 1 ulp


@pytest.mark.parametrize("opt, spread_on, growth_off", [("muon", 1.1, 1.7), ("adamw", 2.0, 2.2)])
def test_update_spectral_norm_is_width_independent_only_with_mup(updates, opt, spread_on, growth_off):
    """Spectral norm of the first update per unit LR over W = 32, 64, 128 (seen: Muon w1 1.82-1.90
    with, 1.82 -> 3.63 without; AdamW w1 12.8-15.2 and wq 9.1-14.4 with, 15 -> 56 and 14 -> 36
    without)."""
    for n in HIDDEN:
        on = [torch.linalg.matrix_norm(updates[(opt, w, BASE)][n], 2).item() for w in WIDTHS]
        off = [torch.linalg.matrix_norm(updates[(opt, w, 0)][n], 2).item() for w in WIDTHS]
        assert max(on) / min(on) < spread_on, (n, on)
        assert off[-1] / off[0] > growth_off, (n, off)


@pytest.mark.parametrize("pp", [1, 2])
def test_hidden_init_std_scales_by_sqrt_base_over_width(pp):
    """With mup_base_width B at width W, every hidden matrix (attention / MLP projections) is the
    unscaled draw times sqrt(B / W) exactly; the embedding, head and norms are the unscaled ones.
    pp = 2: the stage builder applies the same rule (its stage's layers equal the whole model's)."""
    from ndtrain.model import build_model
    from ndtrain.parallel.pp.stage import build_pipeline_stage

    w = 128
    cfg = tiny_config({"model.dim": w, "model.ffn_hidden": 2 * w, "training.mup_base_width": BASE}, world=1)
    dtype = getattr(torch, cfg.training.dtype)
    ref = dict(build_model(cfg.model, dtype=dtype, seed=cfg.training.seed).named_parameters())
    if pp == 1:
        got = dict(Trainer(cfg, ParallelDims(world_size=1).build_mesh(), torch.device("cpu")).model.named_parameters())
    else:  # both stages built in this process (the builder reads only its pp rank from the mesh)
        from types import SimpleNamespace

        cfg.parallel.pp, got = 2, {}
        for rank in (0, 1):
            mesh = SimpleNamespace(group=lambda axis, r=rank: SimpleNamespace(rank=r, size=2))
            stage = build_pipeline_stage(cfg, mesh, torch.device("cpu"), dtype, cfg.training.seed,
                                         hidden_init_factor(w, BASE))
            got.update(dict(stage.named_parameters()))
    f = math.sqrt(BASE / w)
    assert len(got) >= 8
    for n, p in got.items():
        base = n.split(".")[-2] if n.endswith(".weight") else ""
        hidden = p.dim() >= 2 and base in ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
        torch.testing.assert_close(p.detach(), ref[n].detach() * (f if hidden else 1.0), rtol=0, atol=0,
                                   msg=n)
    assert any(n.endswith("wq.weight") for n in got) and any(n.startswith("tok_embeddings") for n in got)
