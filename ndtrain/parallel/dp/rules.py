"""Batch rules of data parallel: how a global batch splits over dp ranks and microbatches.

Called by ``ndtrain.validate`` and by the planner's feasibility check; raises ``ConfigError``
naming the rule. Pure Python.
"""
from __future__ import annotations

from ndtrain.errors import require


def check_batch(global_batch_size: int, dp: int, micro_batch_size: int = 0, pp: int = 1,
                pp_microbatches: int = 0) -> None:
    """The global batch (sequences) splits evenly over the ``dp`` ranks and each local batch into
    whole microbatches (``micro_batch_size`` 0 = the whole local batch); under pp every one of
    the ``pp_microbatches`` microbatches gets >= 1 sequence."""
    require(global_batch_size % dp == 0,
            f"global_batch_size ({global_batch_size}) is not divisible by the data-parallel degree "
            f"dp_replicate*dp_shard ({dp})")
    local = global_batch_size // dp
    mb = micro_batch_size or local
    require(local % mb == 0, f"local batch ({local} = global_batch_size / dp) is not divisible by "
                             f"micro_batch_size ({mb})")
    n_micro = pp_microbatches or local // mb
    require(pp == 1 or n_micro <= local,
            f"pp_microbatches ({n_micro}) exceeds the local batch ({local} sequences = global_batch_size "
            "/ dp): every microbatch needs >= 1 sequence")
