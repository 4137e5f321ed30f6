"""Pipeline parallel against the single-process oracle, under jitter, and its measured bubble.

Reference: the same ``Trainer`` built with a world-size-1 layout inside each rank, fed the whole
global batch (one microbatch). The pipeline trainer runs stage ``pp rank`` of the same model
(identical initial weights by per-name seeding) on the same batch cut into m microbatches (m = 3
gives uneven microbatches 3, 3, 2). Tolerance 1e-6 relative in float64 (the issue's contract): the
only differences are the order of floating-point sums (microbatch accumulation, the pp all-reduce
of squared norms), ~1e-15 here, amplified by at most 10 AdamW steps. Clipping is active (the
first step's norm is > 10x the threshold). Labels are masked unevenly so token weighting matters.
lr is 1e-3: at 1e-2 this batch drives the tiny model into a regime where AdamW turns 1e-16 rounding
differences in near-zero (cancellation-dominated) gradients into O(lr) updates, and the
trajectories part by ~1e-7 within 10 steps whatever the parallel layout (measured); at 1e-3 all
errors stay ~1e-16.
"""
from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from ndtrain.config import Config, validate
from ndtrain.mesh import ParallelDims
from ndtrain.parallel.pp.observe import ActionTimer, Jitter
from ndtrain.train.loop import IGNORE_INDEX, Trainer
from tests.dist_utils import run_ranks
from tests.utils import tiny_config

V, T, G, C, STEPS = 64, 8, 8, 32, 10
SCHEDS = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1))


def pp_cfg(pp: int, sched: str = "1f1b", m: int = 0, v: int = 1, tie: bool = False, **par) -> Config:
    return tiny_config({"model.vocab_size": V, "model.dim": C, "model.n_layers": 8, "model.tie_embeddings": tie,
                        "data.seq_len": T, "training.global_batch_size": G, "training.lr": 1e-3},
                       parallel={"pp": pp, "dp_shard": -1, "pp_schedule": sched, "pp_microbatches": m,
                                 "pp_virtual_stages": v, **par})


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    inputs = torch.randint(0, V, (G, T), generator=g)
    labels = torch.randint(0, V, (G, T), generator=g)
    keep = torch.rand(G, T, generator=g) < torch.linspace(0.1, 1.0, G)[:, None]  # 10% .. 100% valid
    return inputs, labels.masked_fill(~keep, IGNORE_INDEX)


def reference(tie: bool, steps: int = STEPS) -> dict:
    ref = Trainer(pp_cfg(1, tie=tie), ParallelDims(world_size=1).build_mesh(), torch.device("cpu"))
    out = [ref.step(*global_batch(s)) for s in range(steps)]
    return {"loss": [o["loss"] for o in out], "gn": [o["grad_norm"] for o in out],
            "params": {n: q.detach().clone() for n, q in ref.model.named_parameters()},
            "exp_avg": {n: ref.optimizer.state[q]["exp_avg"].clone() for n, q in ref.model.named_parameters()}}


def param_diff(model: nn.Module, ref_params: dict[str, torch.Tensor]) -> float:
    """Largest |stage parameter - reference parameter| over the parameters this stage holds (a
    tied head is compared with the reference's embedding, the Parameter it is tied to there)."""
    out = 0.0
    for n, q in model.named_parameters():
        want = ref_params.get(n, ref_params.get("tok_embeddings.weight") if n == "output.weight" else None)
        out = max(out, (q.detach() - want).abs().max().item())
    return out


def expected_pp_bytes(p: int, v: int, r: int, m: int, tie: bool) -> float:
    """Bytes rank r sends on the pp axis per step: one activation (F) or input gradient (B) per
    microbatch and boundary it owns (all microbatches together are the local batch, G x T x C
    float64) plus a 64-byte header each; two 8-byte all-reduces (loss, squared grad norm); the
    tied-embedding gradient all-reduce (V x C float64 over 2 ranks) on the first / last stage."""
    S = p * v
    boundaries = sum(c * p + r < S - 1 for c in range(v)) + sum(c * p + r > 0 for c in range(v))
    out = boundaries * (G * T * C * 8 + 64 * m) + 2 * (2 * (p - 1) / p * 8)
    if tie and r in (0, p - 1):
        out += V * C * 8
    return out


def _grid(rank: int, world: int, configs: list, jitter_s: float = 0.0, steps: int = STEPS) -> dict:
    refs = {tie: reference(tie, steps) for tie in {c[3] for c in configs}}
    mesh = ParallelDims(pp=world, world_size=world).build_mesh()
    res = {}
    for sched, m, v, tie in configs:
        cfg = pp_cfg(world, sched, m, v, tie)
        validate(cfg, world)
        tr = Trainer(cfg, mesh, torch.device("cpu"))
        if jitter_s:  # random per-rank sleeps before every action (an observer of the runtime)
            tr.pipeline.runtime.observers.append(Jitter(jitter_s, cfg.training.seed, rank))
        ref = refs[tie]
        loss_err = gn_err = 0.0
        t0 = time.monotonic()
        for s in range(steps):
            mesh.reset_stats()
            d = tr.step(*global_batch(s))
            sent = mesh.reset_stats()
            loss_err = max(loss_err, abs(d["loss"] - ref["loss"][s]) / ref["loss"][s])
            gn_err = max(gn_err, abs(d["grad_norm"] - ref["gn"][s]) / ref["gn"][s])
            want = expected_pp_bytes(world, v, rank, m, tie)
            assert abs(sent.get("pp", 0.0) - want) < 1e-6, (sched, m, v, tie, sent, want)
        res[(sched, m, v, tie)] = {"loss_err": loss_err, "gn_err": gn_err,
                                   "param_diff": param_diff(tr.model, ref["params"]),
                                   "n_params": len(dict(tr.model.named_parameters())), "gn0": ref["gn"][0],
                                   "s": time.monotonic() - t0}
    return res


def _configs(world: int) -> list:
    grid = [(s, m, v, False) for s, v in SCHEDS for m in (1, 2, 3, 4, 8)]
    tied = [(s, 3, v, True) for s, v in SCHEDS] if world == 2 else [("1f1b", 4, 1, True)]
    return grid + tied


def _check(res: list, world: int) -> None:
    for r in res:
        for key, e in r.items():
            assert e["loss_err"] < 1e-6 and e["gn_err"] < 1e-6, (key, e)
            assert e["param_diff"] < 1e-9, (key, e)
            assert e["gn0"] > 10 * 0.05, "clipping must be active"
    # every parameter lives on exactly one stage (tied head: one extra name on the last stage)
    untied = ("1f1b", 4, 1, False)
    assert sum(r[untied]["n_params"] for r in res) == 8 * 9 + 3


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_pp_reproduces_single_process(world):
    """Every schedule x m in {1, 2, 3, 4, 8} (interleaved with v = 2), plus tied embeddings, in one
    spawn: losses, grad norms (clipped at 0.05) and final parameters over 10 steps, and the exact
    bytes each rank sends on the pp axis."""
    res = run_ranks(_grid, world, _configs(world), timeout_s=280)
    _check(res, world)


@pytest.mark.slow  # costly on 2 cores; the same axis keeps a smaller default test
def test_pp_random_sleeps_no_deadlock():
    """Every rank sleeps uniform(0, 50 ms) before each action (different per rank): no deadlock
    within the bound, and still the single-process losses (timing cannot change the results)."""
    configs = [(s, 3, v, False) for s, v in SCHEDS] + [("interleaved", 5, 2, False)]
    t0 = time.monotonic()
    res = run_ranks(_grid, 4, configs, 0.05, 2, timeout_s=120)
    for r in res:
        for key, e in r.items():
            assert e["loss_err"] < 1e-6 and e["gn_err"] < 1e-6, (key, e)
    assert time.monotonic() - t0 < 120


# --- measured bubble on a toy pipeline with equal, deterministic (sleep) work ----------------------
class _Sleep(torch.autograd.Function):
    """fwd: sleep t_f, identity; bwd: sleep t_b, identity (the input-gradient work)."""

    @staticmethod
    def forward(ctx, x, t_f, t_b):
        time.sleep(t_f)
        ctx.t_b = t_b
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.t_b)
        return g, None, None


class _SleepW(torch.autograd.Function):
    """fwd: identity on a weight; bwd: sleep t_w (the weight-gradient work)."""

    @staticmethod
    def forward(ctx, w, t_w):
        ctx.t_w = t_w
        return w.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.t_w)
        return g, None


class _Scale(nn.Module):
    """Owns the stage's weight: ``x * w``; its backward into ``w`` (the W pass) sleeps ``t``."""

    def __init__(self, t: float):
        super().__init__()
        self.t = t
        self.w = nn.Parameter(torch.ones(1, dtype=torch.float64))

    def forward(self, x):
        return x * _SleepW.apply(self.w, self.t)


class SleepStage(nn.Module):
    """A toy stage with deterministic work: F sleeps t, B (input gradient) t, W (weight gradient)
    t. The first stage starts with a free parameter-owning op, like an embedding, so its B pass
    also has the input-gradient work to do."""

    def __init__(self, t: float, first: bool):
        super().__init__()
        self.t = t
        self.embed = _Scale(0.0) if first else None
        self.scale = _Scale(t)

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x.double()[..., None])  # (B, T, 1)
        return self.scale(_Sleep.apply(x, self.t, self.t))


def _measured_bubble(rank: int, world: int, m: int, t: float, steps: int) -> dict:
    from ndtrain.mesh import ParallelDims
    from ndtrain.parallel.pp.runtime import PipelineRuntime
    from ndtrain.parallel.pp.viz import gather_measured_timeline

    torch.set_num_threads(1)
    mesh = ParallelDims(pp=world, world_size=world).build_mesh()
    out = {}
    for sched, v in SCHEDS:
        chunks = [SleepStage(t / v, first=(rank == 0 and c == 0)) for c in range(v)]
        rt = PipelineRuntime(chunks, mesh.group("pp"), sched, lambda y, _: y.sum())
        timer = ActionTimer()
        rt.observers.append(timer)
        x = torch.zeros(m, 2, dtype=torch.long)
        best = None
        for _ in range(steps):  # keep the least disturbed step (min span), as benchmarks do
            rt.run(x, x, m)
            tl = gather_measured_timeline(timer, mesh.group("pp"))
            if best is None or tl.end - tl.start < best.end - best.start:
                best = tl
        out[sched] = {"bubbles": best.bubbles(), "span": best.end - best.start}
    return out


@pytest.mark.slow  # costly on 2 cores; the same axis keeps a smaller default test
def test_measured_bubble_matches_formula():
    """p = 4, m = 8, F = 20 ms, B = 20 ms (input grad) + 20 ms (weight grad) per rank's share
    (halved per chunk with v = 2): the measured bubble (idle fraction of the step, mean over ranks)
    is within 5 points of (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(vm+p-1) interleaved,
    (p-1)/(3m+p-1) ZB-H1, and every rank's within 10. Of 6 steps the one with the shortest span is
    used: a shared 2-core machine can stretch one rank's 20 ms sleep by tens of ms, which idles the
    others for reasons unrelated to the schedule (observed: one rank at the formula, three 6 points
    above it, in a step whose span the stall had lengthened)."""
    from ndtrain.parallel.pp.schedules import bubble_formula

    res = run_ranks(_measured_bubble, 4, 8, 0.02, 6, timeout_s=150)
    for sched, v in SCHEDS:
        f, bub = bubble_formula(sched, 4, 8, v), res[0][sched]["bubbles"]
        assert abs(sum(bub) / 4 - f) < 0.05, (sched, bub, f)  # the step's bubble: mean over ranks
        assert all(abs(b - f) < 0.10 for b in bub), (sched, bub, f)


# --- the training loop: logging, evaluation, checkpoints that reshard across pp degrees ------------
def test_run_loop_evaluates_checkpoints_and_reshards(tmp_path):
    """Through ``ndtrain.train.loop.run`` on real data (tests/parallel/test_reshard.py's byte corpus,
    float64, tied embeddings, 4 blocks): pp2 1F1B trains steps 1-4 (validation at 0 and 4, the
    last stage's loss shared by all ranks) and saves; one plain process resumes from that pp2
    checkpoint for steps 5-8; pp2 interleaved resumes from the single-process step-4 checkpoint.
    Reference: one uninterrupted single-process run. 1e-6 relative, as the parity tests."""
    from ndtrain.checkpoint import dcp as ckpt
    from ndtrain.data import prepare_data
    from ndtrain.train.loop import run
    from ndtrain.train.metrics import read_metrics
    from tests.parallel.test_reshard import _cfg, _run

    torch.set_num_threads(1)
    over = {"model.n_layers": 4, "model.tie_embeddings": True, "training.steps": 8,
            "training.eval_every": 4}
    cfg = _cfg(tmp_path, 1, **over)
    data = prepare_data(cfg.data, cfg.model.vocab_size)
    run(cfg, tmp_path / "ref", data, torch.device("cpu"))
    run_ranks(_run, 2, str(tmp_path), "pp", {**over, "parallel.pp": 2, "parallel.pp_microbatches": 3,
                                             "training.stop_at_step": 4}, timeout_s=200)
    pp_ckpt = ckpt.latest_checkpoint(tmp_path / "pp" / "checkpoints")
    assert pp_ckpt.name == "step_00000004"
    run(_cfg(tmp_path, 1, **over, **{"checkpoint.load_from": pp_ckpt}), tmp_path / "single", data,
        torch.device("cpu"))
    ref_ckpt = tmp_path / "ref" / "checkpoints" / "step_00000004"
    run_ranks(_run, 2, str(tmp_path), "pp_int", {**over, "parallel.pp": 2, "parallel.pp_schedule": "interleaved",
                                                 "parallel.pp_virtual_stages": 2, "checkpoint.load_from": ref_ckpt},
              timeout_s=200)

    def rows(name, key):
        return {r["step"]: r[key] for r in read_metrics(tmp_path / name) if key in r}

    ref, ref_val = rows("ref", "loss"), rows("ref", "val_loss")
    pairs = [(rows("pp", "loss"), ref, range(1, 5)), (rows("single", "loss"), ref, range(5, 9)),
             (rows("pp_int", "loss"), ref, range(5, 9)), (rows("pp", "val_loss"), ref_val, (0, 4)),
             (rows("single", "val_loss"), ref_val, (8,)), (rows("pp_int", "val_loss"), ref_val, (8,))]
    for got, want, steps in pairs:
        for s in steps:
            assert abs(got[s] - want[s]) <= 1e-6 * want[s], (s, got[s], want[s])
    assert ref[8] < ref[1] - 0.05  # it trains: a resume from scratch would show
