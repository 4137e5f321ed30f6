"""Expert-parallel all-to-all traffic per step against the theory, in the same command.

    python bench/moe_all_to_all.py            # ep = 2 and 4 (gloo, CPU)

A one-layer MoE model (E = 8 experts, top-2, C = 256, float32) processes N = 1024 tokens per rank.
Per MoE layer and direction, uniform routing sends ``N * k * C * b * (ep-1)/ep`` bytes from each
rank (dispatch; combine returns the same rows). The bench counts bytes on the ``ep`` axis through
``ndtrain.parallel.comm`` for one forward (dispatch + combine) and one forward + backward (each
all-to-all's gradient is the reverse all-to-all: 4 transfers), and reports three numbers:

* ``theory``: ``N k C b (ep-1)/ep`` per direction (uniform routing);
* ``exact``: the same from the rows this rank actually sent to other ranks (the routing is random,
  not perfectly uniform), plus the tiny per-expert count exchange;
* ``measured``: what comm counted. measured == exact; measured / theory ~ 1 up to routing noise.

Writes ``bench/results/moe_all_to_all.json``.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ndtrain.config import Config, ModelConfig, ParallelConfig, TrainingConfig
from ndtrain.mesh import ParallelDims
from ndtrain.model import build_model
from ndtrain.model.moe import moe_layers
from ndtrain.parallel.ep import layers as ep_mod
from ndtrain.parallel.parallelize import parallelize
from ndtrain.spawn import spawn

E, K, C, B, T = 8, 2, 256, 8, 128


def _rank(rank: int, world: int) -> dict:
    cfg = Config(model=ModelConfig(vocab_size=512, dim=C, n_layers=1, n_heads=4, ffn_hidden=512, max_seq_len=T,
                                   moe_experts=E, moe_top_k=K, moe_ffn_hidden=256, init_std=0.02),
                 training=TrainingConfig(dtype="float32", global_batch_size=B * world),
                 parallel=ParallelConfig(dp_shard=world, ep=world))
    mesh = ParallelDims.from_config(cfg.parallel, world).build_mesh()
    model = build_model(cfg.model, seed=0)
    parallelize(model, mesh, cfg)
    sent = []  # rows this rank sent to other ranks per dispatch
    orig = ep_mod.AllToAllV.apply

    def spy(x, out_splits, in_splits, group, *rest):
        sent.append(sum(in_splits) - in_splits[group.rank])
        return orig(x, out_splits, in_splits, group, *rest)

    ep_mod.AllToAllV.apply = spy
    x = torch.randint(0, 512, (B, T), generator=torch.Generator().manual_seed(rank))
    mesh.reset_stats()
    logits = model(x)
    fwd = mesh.reset_stats().get("ep", 0.0)
    logits.float().pow(2).mean().backward()
    bwd = mesh.reset_stats().get("ep", 0.0)
    n, ep = B * T, world
    count_bytes = (ep - 1) * (E // ep) * 8  # the (ep, E/ep) int64 count exchange, sent part
    theory = n * K * C * 4 * (ep - 1) / ep
    exact_fwd = sum(sent[:2]) * C * 4 + count_bytes  # dispatch + combine rows (fwd)
    res = {"ep": ep, "rank": rank, "tokens_per_rank": n, "theory_per_direction": theory,
           "measured_fwd": fwd, "exact_fwd": exact_fwd, "measured_fwd_bwd": fwd + bwd,
           "ratio_fwd_vs_2x_theory": fwd / (2 * theory), "ratio_fwd_bwd_vs_4x_theory": (fwd + bwd) / (4 * theory),
           "tally_fwd_bwd": moe_layers(model)[0].stats.a2a_bytes,  # the per-layer counter behind moe_a2a_bytes
           "load_max_mean": float(moe_layers(model)[0].stats.counts.max() / moe_layers(model)[0].stats.counts.mean())}
    return res


def main() -> None:
    rows = []
    for world in (2, 4):
        rows += spawn(_rank, world, backend="gloo", threads=1)
    for r in rows:
        print(f"ep={r['ep']} rank {r['rank']}: theory {r['theory_per_direction'] / 1e6:.3f} MB/direction | "
              f"fwd measured {r['measured_fwd'] / 1e6:.3f} MB = exact {r['exact_fwd'] / 1e6:.3f} MB | "
              f"fwd / (2 x theory) {r['ratio_fwd_vs_2x_theory']:.3f} | fwd+bwd / (4 x theory) "
              f"{r['ratio_fwd_bwd_vs_4x_theory']:.3f} | local load max/mean {r['load_max_mean']:.2f}")
        assert r["measured_fwd"] == r["exact_fwd"]
    out = ROOT / "bench" / "results" / "moe_all_to_all.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"E": E, "top_k": K, "C": C, "dtype": "float32", "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
