"""Layout rules of ZeRO-1/2/3 / FSDP (Rajbhandari 2020).

Called by ``ndtrain.config.validate`` and by the planner's feasibility check; raises ``ConfigError``
naming the rule. Pure Python.
"""
from __future__ import annotations

from ndtrain.errors import require


def check(zero_stage: int, mtp_depth: int = 0) -> None:
    """``zero_stage`` in 0..3 (ZeRO-3 with MTP: each depth is an FSDP unit,
    ``ndtrain.parallel.zero.units``). ``mtp_depth`` is kept for the callers' signature."""
    require(zero_stage in (0, 1, 2, 3), f"parallel.zero_stage ({zero_stage}) must be 0, 1, 2 or 3")
