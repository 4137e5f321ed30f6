"""Layout rules of expert parallel (GShard / Switch); raise ``ConfigError`` naming the rule. Pure Python."""
from __future__ import annotations

from ndtrain.errors import require
from ndtrain.mesh import check_ep_borrow


def check(ep: int, moe_experts: int, dp_shard: int | None = None, cp: int = 1, zero_stage: int = 0,
          shared_overlap: bool = False, shared_ffn: int = 0) -> None:
    """``ep`` divides E and the dp_shard x cp block it borrows (``dp_shard`` None: not known yet); needs an
    MoE model. Every ZeRO stage composes (``zero_stage`` is checked by the ZeRO rules).
    ``shared_overlap`` needs ep > 1 and shared experts (``shared_ffn`` > 0)."""
    require(ep >= 1, f"parallel.ep ({ep}) must be >= 1")
    require(not shared_overlap or (ep > 1 and shared_ffn > 0),
            f"parallel.moe_shared_overlap=true needs ep > 1 and model.moe_shared_experts > 0 (ep={ep}, "
            f"shared experts: {'yes' if shared_ffn else 'none'}): it overlaps the shared experts with the "
            "expert-parallel dispatch all-to-all")
    if dp_shard is not None:
        check_ep_borrow(ep, dp_shard, cp)
    if ep == 1:
        return
    require(moe_experts > 0, f"parallel.ep ({ep}) > 1 needs an MoE model (model.moe_experts > 0)")
    check_experts(moe_experts, ep)


def check_experts(moe_experts: int, ep: int) -> None:
    """Each ep rank holds whole experts: E splits evenly over ``ep``."""
    require(moe_experts % ep == 0, f"moe_experts ({moe_experts}) is not divisible by ep ({ep})")
