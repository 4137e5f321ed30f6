"""Layout rules of ZeRO-1/2/3 / FSDP (Rajbhandari 2020).

Called by ``ndtrain.validate`` and by the planner's feasibility check; raises ``ConfigError``
naming the rule. Pure Python.
"""
from __future__ import annotations

from ndtrain.errors import require


def check(zero_stage: int, mtp_depth: int = 0) -> None:
    """``zero_stage`` in 0..3. ZeRO-3 with MTP modules is rejected: ``ndtrain.parallel.zero.units``
    builds FSDP units from the decoder blocks, embedding and head only, so the ``mtp.*``
    parameters would belong to no unit."""
    require(zero_stage in (0, 1, 2, 3), f"parallel.zero_stage ({zero_stage}) must be 0, 1, 2 or 3")
    require(not (zero_stage == 3 and mtp_depth > 0),
            f"mtp_depth ({mtp_depth}) > 0 with zero_stage 3 is not implemented (the FSDP units of "
            "ndtrain.parallel.zero.units do not cover the mtp.* modules); use zero_stage <= 2")
