"""Layout rules of pipeline parallel (GPipe, 1F1B, interleaved 1F1B of Narayanan 2021, ZB-H1).

Called by ``ndtrain.validate`` and by the planner's feasibility check; raises ``ConfigError``
naming the rule. Pure Python.
"""
from __future__ import annotations

from ndtrain.errors import require

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")


def check(pp: int, n_layers: int, pp_schedule: str = "1f1b", pp_virtual_stages: int = 1,
          pp_microbatches: int = 0, activation_checkpoint: str = "none", moe: bool = False,
          mtp: bool = False, end_stages_may_hold_no_block: bool = False) -> None:
    """Schedule name; ``pp_virtual_stages`` (v) > 1 exactly for the interleaved schedule; every one
    of the pp * v virtual stages holds a block. ``end_stages_may_hold_no_block``: the first / last
    virtual stage may hold only the embedding / head (Llama 3's 126 blocks in 16 x 8 chunks) --
    the planner models that layout, ndtrain's stage builder does not, so validation passes False."""
    v = pp_virtual_stages
    require(pp >= 1, f"parallel.pp ({pp}) must be >= 1")
    require(pp_schedule in SCHEDULES, f"parallel.pp_schedule ({pp_schedule}) must be "
                                      "gpipe|1f1b|interleaved|zero_bubble")
    require(pp_microbatches >= 0, f"parallel.pp_microbatches ({pp_microbatches}) must be >= 0")
    require(v >= 1, f"parallel.pp_virtual_stages ({v}) must be >= 1")
    if pp_schedule == "interleaved":
        require(v >= 2, f"pp_schedule=interleaved needs pp_virtual_stages >= 2 (got {v})")
    else:
        require(v == 1, f"pp_virtual_stages ({v}) > 1 needs pp_schedule=interleaved (got {pp_schedule})")
    if pp == 1:
        return
    spare = 2 if end_stages_may_hold_no_block and v > 1 else 0
    require(n_layers + spare >= pp * v, f"n_layers ({n_layers}) < pp * pp_virtual_stages ({pp * v})"
                                        + (" - 2" if spare else "") + ": every pipeline stage needs at "
                                        "least one block")
    require(not moe and not mtp, f"MoE / MTP models with pp ({pp}) > 1 are not implemented (MoE "
                                 "auxiliary losses and MTP heads are not carried across stages yet)")
    if pp_schedule == "zero_bubble":
        require(activation_checkpoint == "none", "pp_schedule=zero_bubble needs activation_checkpoint=none "
                                                 "(its W pass reuses the activations its B pass kept)")
