"""Layout rules of ZeRO-1/2/3 / FSDP (Rajbhandari 2020); raise ``ConfigError`` naming the rule. Pure
Python."""
from __future__ import annotations

from ndtrain.errors import require


def check(zero_stage: int, mtp_depth: int = 0) -> None:
    """``zero_stage`` in 0..3. ``mtp_depth`` is kept for the callers' signature (ZeRO-3 makes each depth a
    unit)."""
    require(zero_stage in (0, 1, 2, 3), f"parallel.zero_stage ({zero_stage}) must be 0, 1, 2 or 3")
