"""Batch rules of data parallel: how a global batch splits over dp ranks and microbatches.

Called by ``ndtrain.config.validate`` and by the planner's feasibility check; raises ``ConfigError``
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


def check_local_sgd(local_sgd_steps: int, dp_replicate: int, zero_stage: int, moe: bool,
                    outer_lr: float, outer_momentum: float) -> None:
    """DiLoCo / local SGD (``training.local_sgd_steps`` = H; ``ndtrain.parallel.dp.diloco``): the
    replicas are the ``dp_replicate`` axis (> 1); the inner gradient sync is plain DDP within a
    replica (zero_stage 0: ZeRO / HSDP would reduce over dp_replicate every step) and the model
    dense (expert data parallel reduces experts over dp_replicate too); composes with dp_shard,
    tp, pp and cp. Checkpoints may fall anywhere inside an interval: they keep every replica's
    weights and AdamW state."""
    require(local_sgd_steps >= 0, f"training.local_sgd_steps ({local_sgd_steps}) must be >= 0")
    if not local_sgd_steps:
        return
    require(dp_replicate > 1, f"training.local_sgd_steps ({local_sgd_steps}) needs parallel.dp_replicate > 1 "
                              f"(got {dp_replicate}): DiLoCo replicas are the dp_replicate axis")
    require(zero_stage == 0, f"training.local_sgd_steps ({local_sgd_steps}) needs parallel.zero_stage 0 "
                             f"(got {zero_stage}): ZeRO / HSDP would reduce over dp_replicate every step")
    require(not moe, "training.local_sgd_steps with an MoE model is not implemented (expert data "
                     "parallel reduces expert gradients over dp_replicate every step)")
    require(outer_lr > 0, f"training.outer_lr ({outer_lr}) must be > 0")
    require(0 <= outer_momentum < 1, f"training.outer_momentum ({outer_momentum}) must be in [0, 1)")
