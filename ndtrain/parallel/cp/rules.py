"""Layout rules of context parallel: ring attention (Liu 2023) and Ulysses (Jacobs 2023).

Called by ``ndtrain.validate`` and by the planner's feasibility check; raises ``ConfigError``
naming the rule. Pure Python.
"""
from __future__ import annotations

from ndtrain.errors import require

IMPLS = ("ring", "ulysses")
LAYOUTS = ("auto", "load_balanced", "contiguous")


def resolve_layout(impl: str, layout: str) -> str:
    """``auto`` -> load_balanced for ring (balances the causal mask), contiguous for Ulysses."""
    if layout != "auto":
        return layout
    return "load_balanced" if impl == "ring" else "contiguous"


def check(cp: int, seq_len: int, impl: str = "ring", layout: str = "auto", n_heads: int = 1, tp: int = 1,
          sequence_parallel: bool = False, mla: bool = False, mtp: bool = False,
          seq_aux_loss: bool = False, capacity: bool = False) -> None:
    """``seq_len`` (T) cuts into the layout's chunks (2 cp load-balanced, cp contiguous); Ulysses
    splits the heads of a tp rank over cp; under sequence parallel the T / cp tokens of a cp rank
    split over tp; features not implemented under cp > 1 are rejected."""
    require(cp >= 1, f"parallel.cp ({cp}) must be >= 1")
    require(impl in IMPLS, f"parallel.cp_impl ({impl}) must be ring|ulysses")
    require(layout in LAYOUTS, f"parallel.cp_layout ({layout}) must be auto|load_balanced|contiguous")
    if sequence_parallel:
        require(seq_len % (cp * tp) == 0,
                f"sequence parallel: tokens per cp rank (seq_len / cp = {seq_len // cp}) are not "
                f"divisible by tp ({tp})")
    if cp == 1:
        return
    resolved = resolve_layout(impl, layout)
    chunks = 2 * cp if resolved == "load_balanced" else cp
    require(impl == "ring" or resolved == "contiguous",
            "parallel.cp_impl=ulysses needs cp_layout contiguous (or auto)")
    require(seq_len % chunks == 0, f"seq_len ({seq_len}) is not divisible by the {chunks} chunks of the "
                                   f"{resolved} cp layout (cp={cp})")
    if impl == "ulysses":
        check_heads(n_heads // tp, cp)
    require(not mla, f"attention=mla with cp ({cp}) > 1 is not implemented")
    require(not mtp, f"mtp_depth > 0 with cp ({cp}) > 1 is not implemented")
    require(not seq_aux_loss, f"moe_seq_aux_loss_coef > 0 with cp ({cp}) > 1 is not implemented (a cp "
                              "rank sees part of each sequence; the per-sequence loads would need a cp "
                              "all-reduce)")
    require(not capacity, f"moe_capacity_factor > 0 with cp ({cp}) > 1 is not implemented (each cp rank "
                          "would pick the dropped tokens from its own shard of the sequences)")


def check_heads(heads_per_tp_rank: int, cp: int) -> None:
    """Ulysses scatters the query heads of a tp rank over the ``cp`` ranks (all-to-all on H)."""
    require(heads_per_tp_rank % cp == 0, f"Ulysses: heads per tp rank (n_heads / tp = {heads_per_tp_rank}) "
                                         f"are not divisible by cp ({cp})")
