"""Layout rules that belong to no single mesh axis: the activation-checkpointing policy string
(``ndtrain.parallel.activation_ckpt``; Korthikanti 2022 for selective recompute).

Called by ``ndtrain.config.validate`` and the planner's feasibility check; raises ``ConfigError``. Pure Python.
"""
from __future__ import annotations

from ndtrain.errors import require
from ndtrain.parallel.ac_policy import POLICIES, is_valid_policy


def check_activation_checkpoint(ac: str, key: str = "training.activation_checkpoint") -> None:
    """One of ``ac_policy.POLICIES`` (``every:C`` with C >= 1); ``key`` names the field in the message."""
    ok = is_valid_policy(ac)  # ndtrain.parallel.ac_policy: the one parser of the policy string
    require(ok, f"{key} ({ac}) must be {'|'.join(POLICIES)}")
