"""``StageMetrics``: MoE / MTP metrics combined over pp stages with the stage's metric names
gathered once and re-gathered only when a stage's names change (2 gloo ranks, one spawn).

Each step's cached result must equal the uncached ``combine_over_stages`` of the same inputs; a
key that appears on one stage mid-run must show up in that very step (a cache that ignored the
change would drop it, a cache that never re-gathered would desynchronise the all-reduce sizes).
"""
from __future__ import annotations

import torch.distributed as dist

from ndtrain.mesh import AxisGroup
from tests.dist_utils import run_ranks

# per step, per rank: the stage's metrics and its MoE layer count
STEPS = [
    ({"aux_loss": 0.5, "moe_load_max_mean": 1.5, "moe_tokens_per_expert_max": 9.0}, 2,
     {"aux_loss": 0.25, "moe_load_max_mean": 1.2, "moe_tokens_per_expert_max": 11.0, "mtp_loss": 2.0}, 1),
    ({"aux_loss": 0.4, "moe_load_max_mean": 1.4, "moe_tokens_per_expert_max": 8.0}, 2,
     {"aux_loss": 0.20, "moe_load_max_mean": 1.1, "moe_tokens_per_expert_max": 7.0, "mtp_loss": 1.9}, 1),
    ({"aux_loss": 0.3, "moe_load_max_mean": 1.3, "moe_tokens_per_expert_max": 6.0}, 2,  # rank 1: a new key
     {"aux_loss": 0.10, "moe_load_max_mean": 1.0, "moe_tokens_per_expert_max": 12.0, "mtp_loss": 1.8,
      "moe_a2a_bytes": 64.0}, 1),
    ({"aux_loss": 0.2, "moe_load_max_mean": 1.2, "moe_tokens_per_expert_max": 5.0}, 2,
     {"aux_loss": 0.10, "moe_load_max_mean": 1.0, "moe_tokens_per_expert_max": 4.0, "mtp_loss": 1.7,
      "moe_a2a_bytes": 32.0}, 1),
]


def _rank(rank: int, world: int) -> dict:
    from ndtrain.parallel.pp.stage_metrics import StageMetrics, combine_over_stages

    group = AxisGroup("pp", world, rank, dist.group.WORLD)
    cached, got, want, gathers = StageMetrics(group), [], [], []
    for step in STEPS:
        out, n = step[2 * rank], step[2 * rank + 1]
        got.append(cached.combine(out, n))
        want.append(combine_over_stages(out, n, group))
        gathers.append(cached.gathers)
    return {"got": got, "want": want, "gathers": gathers}


def test_cached_names_equal_uncached_and_follow_a_new_key():
    res = run_ranks(_rank, 2)
    for r in res:
        assert r["got"] == r["want"]
        assert r["gathers"] == [1, 1, 2, 2]  # gathered once, again only at the step a key appeared
    first = res[0]["got"]
    assert first[0]["aux_loss"] == 0.75 and first[0]["moe_tokens_per_expert_max"] == 11.0
    assert abs(first[0]["moe_load_max_mean"] - (1.5 * 2 + 1.2) / 3) < 1e-15  # layer-weighted mean
    assert "moe_a2a_bytes" not in first[1] and first[2]["moe_a2a_bytes"] == 64.0
    assert res[1]["got"] == first  # every stage logs the same values
