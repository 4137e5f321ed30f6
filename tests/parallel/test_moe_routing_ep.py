"""Forced-balanced routing (``training.moe_routing: balanced``) does not depend on the layout.

One spawned group of 2 gloo ranks, float64, 6 steps of ``moe_debug`` shrunk (E 8, k 2, T 24, G 4,
micro 2). Reference: a one-process ``Trainer`` on every rank fed the whole global batch. Layouts:
dp2 with ep2, cp2 with ep2 (load-balanced chunks: the round-robin must use positions in the whole
sequence) and tp2 with sequence parallel (the tp ranks route different T pieces). Checked per
step: loss and grad norm at 1e-10 relative; tokens per expert and per ep rank exactly equal to
B T k / E and B T k / ep (and the same figures as the reference); ``moe_routing`` on every
row; the busiest-rank memory the same on both ranks, between the ranks' peaks before and after the
last step; final parameters at 1e-10 (ep layouts; tp's shards are covered by the losses and norms)."""
from __future__ import annotations

import torch

from ndtrain.mesh import ParallelDims
from ndtrain.train.loop import Trainer
from ndtrain.train.metrics import peak_memory_bytes
from tests.dist_utils import run_ranks
from tests.utils import rel_err, tiny_config

G, T, E, K, STEPS = 4, 24, 8, 2, 6
LAYOUTS = {"dp2xep2": {"dp_shard": 2, "ep": 2}, "cp2xep2": {"dp_shard": 1, "cp": 2, "ep": 2},
           "tp2sp": {"dp_shard": 1, "tp": 2, "sequence_parallel": True}}


def make_cfg(world: int, parallel: dict):
    return tiny_config({"training.moe_routing": "balanced", "training.global_batch_size": G,
                        "training.micro_batch_size": 2, "data.seq_len": T}, world=world, preset="moe_debug",
                       parallel=parallel)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    x = torch.randint(0, 61, (G, T), generator=g)
    return x, torch.randint(0, 61, (G, T), generator=g)


def train(tr: Trainer) -> dict:
    mesh = tr.mesh
    dp, rank = mesh.dims.dp, mesh.group("dp").rank
    local = G // dp
    outs, before_last = [], 0
    for step in range(STEPS):
        x, y = batch(step)
        before_last = peak_memory_bytes(torch.device("cpu"))  # peaks only grow: a floor for the last row
        outs.append(tr.step(x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]))
    return {"out": outs, "params": {n: p.detach().clone() for n, p in tr.model.named_parameters()},
            "ep_rank": mesh.group("ep").rank, "ep": mesh.dims.ep, "peak_floor": before_last,
            "peak_after": peak_memory_bytes(torch.device("cpu"))}


def _ranks(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    res = {"ref": train(Trainer(make_cfg(1, {}), ParallelDims(world_size=1).build_mesh(), torch.device("cpu")))}
    for name, par in LAYOUTS.items():
        cfg = make_cfg(world, par)
        torch.manual_seed(0)
        res[name] = train(Trainer(cfg, ParallelDims.from_config(cfg.parallel, world).build_mesh(),
                                  torch.device("cpu")))
    return res


def test_balanced_routing_matches_one_process_under_ep_cp_and_tp():
    res = run_ranks(_ranks, 2, timeout_s=300)
    ref = res[0]["ref"]
    per_expert = G * T * K / E
    for name in LAYOUTS:
        for step in range(STEPS):
            want = ref["out"][step]
            for r in res:
                o, ep = r[name]["out"][step], r[name]["ep"]
                assert rel_err(o["loss"], want["loss"]) < 1e-10, (name, step)
                assert rel_err(o["grad_norm"], want["grad_norm"]) < 1e-10, (name, step)
                assert o["moe_routing"] == "balanced"
                assert o["moe_tokens_per_expert_max"] == o["moe_tokens_per_expert_mean"] == per_expert
                assert o["moe_tokens_per_ep_rank_max"] == o["moe_tokens_per_ep_rank_mean"] == G * T * K / ep
                assert o["moe_load_max_mean_worst"] == want["moe_load_max_mean_worst"] == 1.0
                assert o["moe_peak_mem_bytes_max"] == res[0][name]["out"][step]["moe_peak_mem_bytes_max"]
            assert want["moe_tokens_per_ep_rank_max"] == G * T * K  # one process: one rank holds all
        logged = res[0][name]["out"][-1]["moe_peak_mem_bytes_max"]  # the max over ranks, at the last step
        assert max(r[name]["peak_floor"] for r in res) <= logged <= max(r[name]["peak_after"] for r in res)
        if name.startswith("tp"):  # tp shards the dense weights; losses and norms above cover them
            continue
        for r in res:
            el = E // r[name]["ep"]
            for n, p in r[name]["params"].items():
                q = ref["params"][n]
                if ".experts." in n and r[name]["ep"] > 1:
                    q = q[r[name]["ep_rank"] * el:(r[name]["ep_rank"] + 1) * el]
                assert p.shape == q.shape, (name, n)
                assert rel_err(p, q) < 1e-10, (name, n)
