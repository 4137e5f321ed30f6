"""Layout rules of tensor + sequence parallel (Megatron-LM, Shoeybi 2019; SP, Korthikanti 2022).

Called by ``ndtrain.validate`` (from a ``Config``) and by the planner's feasibility check
(``ndtrain.planner.layout.check_layout``, from a model spec), so the rule text is the same in both.
Pure Python; raises ``ConfigError`` naming the rule and the numbers involved.
"""
from __future__ import annotations

from ndtrain.errors import require


def check(tp: int, n_heads: int, n_kv_heads: int, ffn_hidden: int, sequence_parallel: bool = False,
          moe: bool = False, mla: bool = False, mtp: bool = False) -> None:
    """Heads, kv heads and the FFN hidden size split over ``tp`` ranks; SP needs tp > 1; model
    features not implemented under tp > 1 (MoE experts, MLA, MTP heads) are rejected."""
    require(tp >= 1, f"parallel.tp ({tp}) must be >= 1")
    require(not sequence_parallel or tp > 1, "parallel.sequence_parallel needs tp > 1")
    if tp == 1:
        return
    check_heads(n_heads, n_kv_heads, tp)
    check_ffn(ffn_hidden, tp)
    require(not moe, f"MoE layers with tp ({tp}) > 1 are not implemented (experts are not tensor-parallel)")
    require(not mla, f"attention=mla with tp ({tp}) > 1 is not implemented")
    require(not mtp, f"mtp_depth > 0 with tp ({tp}) > 1 is not implemented")


def check_heads(n_heads: int, n_kv_heads: int, tp: int) -> None:
    """Query heads split over ``tp``; kv heads either split (G % tp == 0) or replicated (tp % G == 0)."""
    require(n_heads % tp == 0, f"n_heads ({n_heads}) is not divisible by tp ({tp})")
    require(n_kv_heads % tp == 0 or tp % n_kv_heads == 0,
            f"n_kv_heads ({n_kv_heads}) and tp ({tp}): one must divide the other (kv heads are split "
            "when n_kv_heads % tp == 0, replicated when tp % n_kv_heads == 0)")


def check_ffn(ffn_hidden: int, tp: int) -> None:
    """The SwiGLU hidden size splits over ``tp`` (column-parallel w1 / w3, row-parallel w2)."""
    require(ffn_hidden % tp == 0, f"ffn hidden ({ffn_hidden}) is not divisible by tp ({tp})")
