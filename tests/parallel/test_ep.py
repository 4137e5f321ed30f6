"""Expert parallel (+ data parallel) against the single-process model.

Reference: a world-size-1 ``Trainer`` inside each rank, fed the whole global batch with
``micro_batch_size`` = the parallel layouts' local batch, so the reference's microbatches are
exactly the ranks' microbatches (the Switch loss uses microbatch-scope statistics; see
``ndtrain.model.moe_balance``); for ``moe_aux_scope = "global"`` the reference takes the whole
batch as one microbatch instead. The model exercises every routing feature at once: sigmoid
scores, group-limited top-2, routed scaling, a shared expert, Switch + sequence-wise + z losses,
and the aux-loss-free bias update (driven by all-reduced global loads). float64, dropless unless
stated. Tolerance 1e-6 relative (the issue's contract): EP only moves rows between ranks and
reorders sums (all-to-all, edp/dp all-reduces), ~1e-13 in float64 even after 10 AdamW steps; a
wrong gradient scale (e.g. averaging over edp) or a misrouted row is off by O(1).
"""
from __future__ import annotations

import pytest
import torch

from ndtrain.config import Config, validate
from ndtrain.mesh import ParallelDims
from ndtrain.model.moe import moe_layers
from ndtrain.train.loop import IGNORE_INDEX, Trainer
from tests.dist_utils import run_ranks
from tests.parallel.test_tp import FakeMesh
from tests.utils import tiny_config

V, T, G, E, STEPS = 64, 8, 8, 8, 10


# the MoE model of the ep tests: sigmoid scores, grouped routing, shared expert, every auxiliary loss
MOE = {"model.vocab_size": V, "model.max_seq_len": 32, "model.init_std": 0.1, "model.moe_experts": E,
       "model.moe_top_k": 2, "model.moe_ffn_hidden": 16, "model.moe_shared_experts": 1, "model.moe_score": "sigmoid",
       "model.moe_n_groups": 2, "model.moe_topk_groups": 2, "model.moe_route_scale": 1.5,
       "model.moe_aux_loss_coef": 0.01, "model.moe_seq_aux_loss_coef": 0.01, "model.moe_z_loss_coef": 0.001,
       "model.moe_bias_update_rate": 0.01, "data.seq_len": T, "training.global_batch_size": G}


def moe_cfg(world: int, ep: int, micro: int, cp: int = 1, **kw) -> Config:
    return tiny_config({**MOE, "training.micro_batch_size": micro}, world=world, model=kw,
                       parallel={"dp_shard": world // cp, "cp": cp, "ep": ep})


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randint(0, V, (G, T), generator=g)
    y = torch.randint(0, V, (G, T), generator=g)
    y[torch.rand(G, T, generator=g) < 0.25] = IGNORE_INDEX
    return x, y


def train(tr: Trainer, rank: int, world: int, steps: int = STEPS) -> dict:
    """Run ``steps`` steps on this rank's slice; record losses, grad norms, step-0 gradients (as
    synced, before clipping) and step-0 bytes per axis."""
    rec = {"loss": [], "aux": [], "gn": [], "load": []}
    orig_clip = tr.dp.clip_grad_norm

    def capture(max_norm, mesh):
        rec.setdefault("grads", {n: p.grad.clone() for n, p in tr.model.named_parameters()})
        return orig_clip(max_norm, mesh)

    tr.dp.clip_grad_norm = capture
    local, dp_rank = G // tr.mesh.dims.dp, tr.mesh.group("dp").rank
    for step in range(steps):
        x, y = global_batch(step)
        tr.mesh.reset_stats()
        out = tr.step(x[dp_rank * local:(dp_rank + 1) * local], y[dp_rank * local:(dp_rank + 1) * local])
        rec.setdefault("bytes", tr.mesh.reset_stats())
        rec["loss"].append(out["loss"])
        rec["aux"].append(out["aux_loss"])
        rec["gn"].append(out["grad_norm"])
        rec["load"].append(out["moe_load_max_mean"])
    rec["params"] = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    rec["bias"] = [m.expert_bias.clone() for m in moe_layers(tr.model)]
    return rec


def compare(rank_rec: dict, ref: dict, ep_rank: int, ep: int) -> float:
    """Largest relative difference over losses, aux losses, grad norms, step-0 gradients and final
    parameters; expert tensors are compared with this rank's slice of the reference."""
    worst = 0.0
    for key in ("loss", "aux", "gn"):
        for a, b in zip(rank_rec[key], ref[key]):
            worst = max(worst, abs(a - b) / abs(b))
    el = E // ep
    for key in ("grads", "params"):
        for n, t in rank_rec[key].items():
            r = ref[key][n]
            if ".experts." in n:
                r = r[ep_rank * el:(ep_rank + 1) * el]
            worst = max(worst, ((t - r).abs().max() / r.abs().max().clamp(min=1e-30)).item())
    for a, b in zip(rank_rec["bias"], ref["bias"]):
        assert torch.equal(a, b)  # sign updates from identical global loads
    return worst


def _layouts(rank: int, world: int, layouts: list[tuple[int, str, int]]) -> dict:
    refs, out = {}, {}
    for ep, scope, cp in layouts:
        kw = dict(moe_aux_scope=scope, moe_seq_aux_loss_coef=0.0 if cp > 1 else 0.01)
        if (scope, cp) not in refs:
            micro = G // (world // cp) if scope == "microbatch" else 0
            ref_tr = Trainer(moe_cfg(1, 1, micro, **kw), ParallelDims(world_size=1).build_mesh(), torch.device("cpu"))
            refs[(scope, cp)] = train(ref_tr, 0, 1)
        cfg = moe_cfg(world, ep, 0, cp=cp, **kw)
        mesh = ParallelDims.from_config(cfg.parallel, world).build_mesh()
        tr = Trainer(cfg, mesh, torch.device("cpu"))
        rec = train(tr, rank, world)
        expert_numel = sum(p.numel() for n, p in tr.model.named_parameters() if ".experts." in n)
        dense_numel = sum(p.numel() for n, p in tr.model.named_parameters() if ".experts." not in n)
        out[(ep, scope, cp)] = {"rel": compare(rec, refs[(scope, cp)], mesh.group("ep").rank, ep), "bytes": rec["bytes"],
                            "expert_numel": expert_numel, "dense_numel": dense_numel,
                            "edp": mesh.group("edp").size, "load": rec["load"], "loss": rec["loss"]}
    return out


def check_bytes(r: dict, world: int, ep: int) -> None:
    """Dense gradients all-reduce over dp (world ranks), expert gradients over edp only."""
    b, edp = r["bytes"], r["edp"]
    if ep == 1:  # plain DDP: every parameter over dp
        assert b["dp"] == 2 * (world - 1) / world * (r["dense_numel"] + r["expert_numel"]) * 8
        return
    assert b["dp"] == 2 * (world - 1) / world * r["dense_numel"] * 8
    assert b.get("edp", 0.0) == 2 * (edp - 1) / edp * r["expert_numel"] * 8
    assert b["ep"] > 0


def test_ep_dp_layouts_world4_match_single_process():
    """EP1xDP4, EP2xDP2, EP4xDP1 (world 4, global batch 8): losses, aux losses, grad norms,
    step-0 expert / router / dense gradients and final parameters vs the single process. Plus EP4
    borrowing cp ranks (dp_shard 2 x cp 2, global-scope Switch loss, no sequence-wise loss)."""
    layouts = [(1, "microbatch", 1), (2, "microbatch", 1), (4, "microbatch", 1), (4, "global", 2)]
    res = run_ranks(_layouts, 4, layouts, timeout_s=240)
    for r in res:
        for (ep, _, cp), v in r.items():
            assert v["rel"] < 1e-6, (ep, cp, v["rel"])
            if cp == 1:
                check_bytes(v, 4, ep)
    assert res[0][(2, "microbatch", 1)]["edp"] == 2 and res[0][(4, "microbatch", 1)]["edp"] == 1


def _world2(rank: int, world: int, ckpt_dir: str) -> dict:
    out = _layouts(rank, world, [(2, "microbatch", 1), (2, "global", 1)])
    out["zero_tokens"] = _zero_token_rank(rank, world)
    out["ckpt"] = _checkpoint_round_trip(rank, world, ckpt_dir)
    return out


def _zero_token_rank(rank: int, world: int) -> dict:
    """Selection biases that send every token to experts 0-3 (all on ep rank 0): ep rank 1's
    experts get no rows. No hang; its expert gradients are zeros (not None) and AdamW still steps
    their state; losses still match the single process."""
    def build(w, ep, micro):
        cfg = moe_cfg(w, ep, micro, moe_bias_update_rate=0.0, moe_n_groups=1, moe_topk_groups=1)
        mesh = ParallelDims.from_config(cfg.parallel, w).build_mesh()
        tr = Trainer(cfg, mesh, torch.device("cpu"))
        for m in moe_layers(tr.model):
            m.expert_bias.copy_(torch.tensor([10.0] * 4 + [-10.0] * 4))
        return tr
    ref = train(build(1, 1, G // world), 0, 1, steps=3)
    tr = build(world, 2, 0)
    rec = train(tr, rank, world, steps=3)
    experts = [p for n, p in tr.model.named_parameters() if ".experts." in n]
    return {"rel": max(abs(a - b) / b for a, b in zip(rec["loss"], ref["loss"])),
            "grad_abs": max(rec["grads"][n].abs().max().item() for n in rec["grads"] if ".experts." in n),
            "steps": [int(tr.optimizer.state[p]["step"]) for p in experts]}


def _checkpoint_round_trip(rank: int, world: int, ckpt_dir: str) -> dict:
    """Save under EP2 (expert weights and AdamW moments as DTensor shards), reload under EP2 and
    under EP1 x DP2 (full experts on each rank): every value comes back."""
    from pathlib import Path

    from ndtrain.checkpoint import dcp as ckpt

    cfg = moe_cfg(world, 2, 0)
    src = Trainer(cfg, ParallelDims.from_config(cfg.parallel, world).build_mesh(), torch.device("cpu"))
    train(src, rank, world, steps=2)
    path = ckpt.save_checkpoint(Path(ckpt_dir), 2, src.tensor_state(), {"step": 2})
    el, worst = E // 2, 0.0
    for ep in (2, 1):
        c = moe_cfg(world, ep, 0)
        dst = Trainer(c, ParallelDims.from_config(c.parallel, world).build_mesh(), torch.device("cpu"))
        state = dst.tensor_state()
        ckpt.load_checkpoint(path, state)
        dst.load_tensor_state(state)
        sp = dict(src.model.named_parameters())
        for n, p in dst.model.named_parameters():
            q = p.detach()
            if ".experts." in n and ep == 1:
                q = q[rank * el:(rank + 1) * el]
            worst = max(worst, (q - sp[n].detach()).abs().max().item())
            avg_src = src.optimizer.state[sp[n]]["exp_avg"]
            avg_dst = dst.optimizer.state[p]["exp_avg"]
            if ".experts." in n and ep == 1:
                avg_dst = avg_dst[rank * el:(rank + 1) * el]
            worst = max(worst, (avg_dst - avg_src).abs().max().item())
    return {"worst": worst}


def test_ep2_world2_scopes_zero_tokens_and_checkpoint(tmp_path):
    """World 2: EP2 with microbatch- and global-scope Switch loss vs single process; a rank whose
    experts receive no tokens; checkpoint save / reload across ep degrees."""
    res = run_ranks(_world2, 2, str(tmp_path), timeout_s=240)
    for r in res:
        for key in ((2, "microbatch", 1), (2, "global", 1)):
            assert r[key]["rel"] < 1e-6, (key, r[key]["rel"])
            check_bytes(r[key], 2, 2)
        z = r["zero_tokens"]
        assert z["rel"] < 1e-6 and z["steps"] == [3] * len(z["steps"])
        assert r["ckpt"]["worst"] == 0.0
    assert res[1]["zero_tokens"]["grad_abs"] == 0.0  # ep rank 1 saw no tokens: zero gradients
    assert res[0]["zero_tokens"]["grad_abs"] > 0.0
    # the two scopes give different aux losses (different statistics), both matched above
    assert res[0][(2, "microbatch", 1)]["loss"] != res[0][(2, "global", 1)]["loss"]


@pytest.mark.parametrize("bad,rule", [({"parallel.ep": "3"}, r"ep\*expert_tp \(3\) does not divide the ranks of a pp stage \(dp_replicate\*dp_shard\*cp\*tp = 4\)")])
def test_ep_layout_rules(bad, rule):
    from ndtrain.config import ConfigError, apply_overrides

    cfg = moe_cfg(4, 1, 0)
    apply_overrides(cfg, {"model.moe_experts": "6", **bad})
    with pytest.raises(ConfigError, match=rule):
        validate(cfg, 4)


def test_repr_shows_the_experts_a_rank_holds():
    """``apply_ep`` replaces each MoE layer's experts by an ``ExpertParallelExperts`` module that
    prints its expert range and holds exactly that slice of the full weights, under the same names."""
    from ndtrain.model import build_model
    from ndtrain.parallel.ep.expert_parallel import apply_ep

    cfg = moe_cfg(2, ep=2, micro=0)
    model = build_model(cfg.model, "cpu", torch.float64, 0)
    keys = list(model.state_dict())
    full = {n: p.detach().clone() for n, p in model.named_parameters() if ".experts." in n}
    names = apply_ep(model, FakeMesh(1, ep=2), cfg)
    assert "(experts): ExpertParallelExperts(experts [4, 8) of 8 on ep2 rank 1, hidden=16, dim=32" in repr(model)
    assert list(model.state_dict()) == keys
    assert sorted(names) == sorted(full)
    named = dict(model.named_parameters())
    for n, w in full.items():
        assert torch.equal(named[n], w[4:8]) and named[n].ndtrain_shard_axes == ("ep",)
