"""Layout rules of expert parallel (GShard / Switch); raise ``ConfigError`` naming the rule. Pure Python."""
from __future__ import annotations

from ndtrain.errors import require
from ndtrain.mesh import check_expert_mesh, expert_folded


def check(ep: int, moe_experts: int, dp_shard: int | None = None, cp: int = 1, zero_stage: int = 0,
          shared_overlap: bool = False, shared_ffn: int = 0, tp: int = 1, expert_tp: int = 1, edp: int = 0,
          pp: int = 1, dp_replicate: int = 1) -> None:
    """``ep`` divides E; the expert mesh fits the stage (``ndtrain.mesh.check_expert_mesh``: ep
    borrowed from dp_shard x cp, or folded with expert_tp; ``dp_shard`` None: not known yet);
    ep > 1 or a folded expert_tp needs an MoE model. Every ZeRO stage composes with the borrowed
    layout and with a folded ep; a folded expert_tp (split over ranks other than the attention
    tp) needs ``zero_stage`` 0. ``shared_overlap`` needs ep > 1 and shared experts (``shared_ffn`` > 0)."""
    require(ep >= 1, f"parallel.ep ({ep}) must be >= 1")
    require(not shared_overlap or (ep > 1 and shared_ffn > 0),
            f"parallel.moe_shared_overlap=true needs ep > 1 and model.moe_shared_experts > 0 (ep={ep}, "
            f"shared experts: {'yes' if shared_ffn else 'none'}): it overlaps the shared experts with the "
            "expert-parallel dispatch all-to-all")
    if dp_shard is not None:
        check_expert_mesh(ep, expert_tp, edp, pp, dp_replicate, dp_shard, cp, tp)
    # expert_tp other than 1 / tp always folds; expert_tp = tp folds when ep leaves dp_shard x cp
    folded_split = expert_tp > 1 and (expert_tp != tp or (dp_shard is not None
                                                          and expert_folded(ep, expert_tp, dp_shard, cp, tp)))
    if folded_split:
        require(moe_experts > 0, f"parallel.expert_tp ({expert_tp}) needs an MoE model (model.moe_experts > 0)")
        require(zero_stage == 0, f"parallel.expert_tp ({expert_tp}) on a folded expert mesh needs "
                                 f"parallel.zero_stage 0 (got {zero_stage}): ZeRO's expert domain shards "
                                 "whole experts only")
    if ep == 1:
        return
    require(moe_experts > 0, f"parallel.ep ({ep}) > 1 needs an MoE model (model.moe_experts > 0)")
    check_experts(moe_experts, ep)


def check_experts(moe_experts: int, ep: int) -> None:
    """Each ep rank holds whole experts: E splits evenly over ``ep``."""
    require(moe_experts % ep == 0, f"moe_experts ({moe_experts}) is not divisible by ep ({ep})")
