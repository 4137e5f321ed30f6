"""The activation-checkpointing policy string (``training.activation_checkpoint``), parsed once.

Pure Python (no torch), so validation (``ndtrain.parallel.rules``), the planner
(``ndtrain.planner.layout``) and the mechanism (``ndtrain.parallel.activation_ckpt``) share this
one parser and the one list of policies (``POLICIES``). Policies: ``none | full | every:C | sqrt |
selective | op | core_attn | deepseek`` (see ``activation_ckpt`` and ``ac_recompute``; Chen et al.
2016 for segments, Korthikanti et al. 2022 for core-attention recompute, torchtitan's op-level
selective checkpointing, DeepSeek-V3 section 3.2.3 for RMSNorm / MLA up-projection recompute).
"""
from __future__ import annotations

import math

POLICIES = ("none", "full", "every:C", "sqrt", "selective", "op", "core_attn", "deepseek")  # every form
# per-block op-level policies (a selective-checkpoint region per block; kind "selective"):
SAC_POLICIES = ("selective", "op")
# recompute of named parts only, no block region (``ndtrain.parallel.ac_recompute``)
PART_POLICIES = ("core_attn", "deepseek")


def example_policies(c: int = 2) -> tuple[str, ...]:
    """One concrete policy of each form, ``every:C`` as ``every:c``: what sweeps and benchmarks run."""
    return tuple(f"every:{c}" if p == "every:C" else p for p in POLICIES)


def parse_policy(policy: str, n_layers: int = 1) -> tuple[str, int]:
    """``policy`` -> (kind, blocks per segment): ("none", 0), ("segment", C), ("selective", 1) for
    ``selective`` / ``op`` or ("parts", 0) for ``core_attn`` / ``deepseek``.

    ``full`` is ("segment", 1); ``sqrt`` is ("segment", round(sqrt(n_layers))), at least 1.
    Raises ValueError for an unknown policy or ``every:C`` with C < 1.
    """
    if policy == "none":
        return "none", 0
    if policy == "full":
        return "segment", 1
    if policy == "sqrt":
        return "segment", max(1, round(math.sqrt(n_layers)))
    if policy in SAC_POLICIES:
        return "selective", 1
    if policy in PART_POLICIES:
        return "parts", 0
    if policy.startswith("every:") and policy[6:].isdigit() and int(policy[6:]) >= 1:
        return "segment", int(policy[6:])
    raise ValueError(f"activation_checkpoint {policy!r} must be {'|'.join(POLICIES)}")


def is_valid_policy(policy: str) -> bool:
    """True when ``parse_policy`` accepts ``policy``."""
    try:
        parse_policy(policy)
    except ValueError:
        return False
    return True


def every_blocks(policy: str, n_layers: int) -> int:
    """The C of the two-level ``every:C`` policy (``sqrt``: round(sqrt(L))); 0 for ``none``,
    ``full`` (one-level: each block its own segment) and the selective / part policies. Raises ValueError like
    ``parse_policy``."""
    kind, c = parse_policy(policy, n_layers)
    return c if kind == "segment" and policy != "full" else 0
