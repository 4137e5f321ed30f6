"""Flat vs hierarchical MoE dispatch (``parallel.moe_dispatch``), under learned and forced-balanced
routing (``training.moe_routing``): step time, the share of the step blocked in the dispatch / combine
all-to-alls, bytes per hop and the busiest rank's memory, with ratios against flat in the same run.

    python bench/moe_dispatch.py              # 6 timed steps per setting
    python bench/moe_dispatch.py --steps 3    # quicker

Four gloo ranks form two 2-rank "nodes" (``node_size`` 2, ``dp_shard = ep = 4``) and train one MoE
model (2 layers, C = 128, E = 16 experts of hidden 128, top-4, float32) on the same global batch
(4 x 4 sequences of 64 tokens). The four settings alternate step by step, so machine noise hits them
alike; medians over steps of the slower rank. Routing is not node-limited (``moe_max_nodes`` 0), so
flat and hierarchical route the same tokens to the same experts and their losses must agree.

"Blocked" is the time this rank waits in ``Work.wait`` of an all-to-all on the ``ep``, ``ep_inter``,
``ep_intra`` or ``ep_route`` axes (a bench-only observer around the flight recorder's ``wait``). On
one CPU machine every hop costs the same, so the time ratio says nothing about a real network: the
cross-node bytes (``ep_inter``, or for flat the share of ``ep`` bound for the other node, computed
from the routing) are the figure that carries over. Writes ``bench/results/moe_dispatch.json``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.moe_overlap import WaitTimer
from ndtrain.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainingConfig
from ndtrain.mesh import ParallelDims
from ndtrain.model.moe import moe_layers
from ndtrain.parallel import flight_recorder
from ndtrain.spawn import spawn
from ndtrain.tools.bench_utils import write_result
from ndtrain.train.loop import Trainer

C, L, FE, E, K, B, T, VOCAB, WORLD, NODE = 128, 2, 128, 16, 4, 4, 64, 1024, 4, 2
SETTINGS = [(d, r) for r in ("learned", "balanced") for d in ("flat", "hierarchical")]
AXES = ("ep", "ep_inter", "ep_intra", "ep_route")


def make(dispatch: str, routing: str) -> Trainer:
    m = ModelConfig(vocab_size=VOCAB, dim=C, n_layers=L, n_heads=8, ffn_hidden=K * FE, max_seq_len=T,
                    moe_experts=E, moe_top_k=K, moe_ffn_hidden=FE)
    cfg = Config(model=m, data=DataConfig(seq_len=T),
                 training=TrainingConfig(dtype="float32", global_batch_size=B * WORLD, micro_batch_size=0,
                                         lr=1e-3, warmup_steps=0, moe_routing=routing),
                 parallel=ParallelConfig(dp_shard=WORLD, ep=WORLD, node_size=NODE, moe_dispatch=dispatch))
    return Trainer(cfg, ParallelDims.from_config(cfg.parallel, WORLD).build_mesh(), torch.device("cpu"))


def cross_node_rows(tr: Trainer, ep_rank: int) -> list:
    """Wrap the MoE layers' experts to count, per training call, the rows bound for the other node."""
    calls = []
    per = E // (WORLD // NODE)
    for moe in moe_layers(tr.model):
        fwd = moe.experts.forward

        def wrapped(xs, counts, *rest, _fwd=fwd, **kw):
            node = torch.arange(E).repeat_interleave(counts) // per
            calls.append(int((node != ep_rank // NODE).sum()))
            return _fwd(xs, counts, *rest, **kw)

        moe.experts.forward = wrapped
    return calls


def _rank(rank: int, world: int, steps: int) -> dict:
    timer = WaitTimer(flight_recorder.configure(600.0, 0, None))
    runs = {f"{d}/{r}": make(d, r) for d, r in SETTINGS}
    remote = {k: cross_node_rows(tr, tr.mesh.group("ep").rank) for k, tr in runs.items()}
    samples: dict[str, list[dict]] = {k: [] for k in runs}
    for step in range(steps + 1):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, VOCAB, (B * world, T), generator=g)[rank * B:(rank + 1) * B]
        for name, tr in runs.items():
            dist.barrier()
            timer.blocked, _ = {}, tr.mesh.reset_stats()
            remote[name].clear()
            t0 = time.perf_counter()
            out = tr.step(x, torch.roll(x, -1, 1))
            wall = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)  # the slower rank sets the step time
            if step >= 1:  # warm-up
                blocked = sum(v for k, v in timer.blocked.items() if k.split(":")[0] in AXES and "all_to_all" in k)
                samples[name].append({"wall_s": wall.item(), "a2a_s": blocked, "loss": out["loss"],
                                      "bytes": {a: v for a, v in tr.mesh.reset_stats().items() if a in AXES},
                                      "remote_rows_fwd": sum(remote[name]),
                                      "peak": out.get("moe_peak_mem_bytes_max", 0.0),
                                      "per_rank_max": out["moe_tokens_per_ep_rank_max"],
                                      "per_rank_mean": out["moe_tokens_per_ep_rank_mean"]})
    res = {"rank": rank}
    for name, rows in samples.items():
        med = statistics.median(r["wall_s"] for r in rows)
        a2a = statistics.median(r["a2a_s"] for r in rows)
        res[name] = {"step_median_s": med, "a2a_blocked_median_s": a2a, "a2a_share": a2a / med,
                     "bytes_per_step": {a: statistics.median(r["bytes"].get(a, 0.0) for r in rows) for a in AXES},
                     "remote_rows_fwd": statistics.median(r["remote_rows_fwd"] for r in rows),
                     "busiest_rank_mem_bytes": max(r["peak"] for r in rows),
                     "tokens_per_ep_rank_max_mean": [rows[-1]["per_rank_max"], rows[-1]["per_rank_mean"]],
                     "losses": [r["loss"] for r in rows]}
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    rows = spawn(_rank, WORLD, (args.steps,), backend="gloo", threads=1, timeout_s=1800)
    out = {"world": WORLD, "node_size": NODE, "model": {"C": C, "L": L, "E": E, "k": K, "hidden": FE},
           "tokens_per_rank": B * T, "steps": args.steps, "settings": {}}
    for d, r in SETTINGS:
        name = f"{d}/{r}"
        row = {k: max(x[name][k] for x in rows) for k in ("step_median_s", "busiest_rank_mem_bytes")}
        row["a2a_share"] = max(x[name]["a2a_share"] for x in rows)
        row["bytes_per_step_all_ranks"] = {a: sum(x[name]["bytes_per_step"][a] for x in rows) for a in AXES}
        row["tokens_per_ep_rank_max_mean"] = rows[0][name]["tokens_per_ep_rank_max_mean"]
        # cross-node bytes over all ranks: hierarchical counts them (ep_inter); flat sends each remote
        # row once per direction, forward and backward (4 x rows x C x 4 bytes)
        remote = sum(x[name]["remote_rows_fwd"] for x in rows)
        row["cross_node_bytes"] = (row["bytes_per_step_all_ranks"]["ep_inter"] if d == "hierarchical"
                                   else 4 * remote * C * 4)
        row["losses_rank0"] = rows[0][name]["losses"]
        out["settings"][name] = row
    for d, r in SETTINGS:
        row, base = out["settings"][f"{d}/{r}"], out["settings"][f"flat/{r}"]
        row["vs_flat"] = {"step_time": row["step_median_s"] / base["step_median_s"],
                          "cross_node_bytes": row["cross_node_bytes"] / base["cross_node_bytes"],
                          "busiest_rank_mem": row["busiest_rank_mem_bytes"] / max(base["busiest_rank_mem_bytes"], 1),
                          "losses_max_rel_diff": max(abs(a - b) / abs(b) for a, b in
                                                     zip(row["losses_rank0"], base["losses_rank0"]))}
        print(f"{d:12s} {r:8s} step {row['step_median_s'] * 1e3:7.1f} ms  a2a {row['a2a_share']:.1%}  "
              f"cross-node {row['cross_node_bytes'] / 1e6:6.2f} MB  mem {row['busiest_rank_mem_bytes'] / 2**20:6.1f} MiB  "
              f"vs flat: time {row['vs_flat']['step_time']:.2f}x bytes {row['vs_flat']['cross_node_bytes']:.2f}x")
    path = write_result(ROOT / "bench" / "results" / "moe_dispatch.json", out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
