"""Layout rules of tensor + sequence parallel (Megatron-LM, Shoeybi 2019; SP, Korthikanti 2022).

Called by ``ndtrain.config.validate`` (from a ``Config``) and by the planner's feasibility check
(``ndtrain.planner.layout.check_layout``, from a model spec), so the rule text is the same in both.
Pure Python; raises ``ConfigError`` naming the rule and the numbers involved.
"""
from __future__ import annotations

import math

from ndtrain.errors import require
from ndtrain.mixer_spec import linear_dims


def check(tp: int, n_heads: int, n_kv_heads: int, ffn_hidden: int, sequence_parallel: bool = False,
          moe: bool = False, mla: bool = False, mtp: bool = False) -> None:
    """Heads, kv heads and the FFN hidden size split over ``tp`` ranks; SP needs tp > 1; model
    features not implemented under tp > 1 are rejected. MLA and MTP are split by
    ``ndtrain.parallel.tp.plan`` (MLA's heads are ``n_heads``); MTP with MoE layers runs with
    and without SP (``moe``, ``mla``, ``mtp`` are accepted for the planner's signature)."""
    require(tp >= 1, f"parallel.tp ({tp}) must be >= 1")
    require(not sequence_parallel or tp > 1, "parallel.sequence_parallel needs tp > 1")
    if tp == 1:
        return
    check_heads(n_heads, n_kv_heads, tp)
    check_ffn(ffn_hidden, tp)
    # MoE layers: tp.moe_layers (each tp rank routes its T/tp tokens); their rules are in check_moe
    # MLA heads split like attention heads (tp.plan); MTP blocks like the decoder blocks. Under SP
    # (and without SP for MoE MTP blocks) the MTP depths run on all T positions, padded at the last k,
    # which their MoE layers mask out of routing and statistics (MoE.token_mask): no rule needed


def check_heads(n_heads: int, n_kv_heads: int, tp: int) -> None:
    """Query heads split over ``tp``; kv heads either split (G % tp == 0) or replicated (tp % G == 0)."""
    require(n_heads % tp == 0, f"n_heads ({n_heads}) is not divisible by tp ({tp})")
    require(n_kv_heads % tp == 0 or tp % n_kv_heads == 0,
            f"n_kv_heads ({n_kv_heads}) and tp ({tp}): one must divide the other (kv heads are split "
            "when n_kv_heads % tp == 0, replicated when tp % n_kv_heads == 0)")


def check_mixer_heads(tp: int, mixers: tuple[str, ...], m) -> None:
    """The head counts the non-softmax ``mixers`` (``mixer_spec.non_softmax_mixers``) split over
    ``tp`` (the softmax family's are ``check_heads``'): Gated DeltaNet's key heads, Mamba-2's B / C
    groups (heads of a group share B, C and the gated-norm group, so whole groups go to one rank;
    ``mamba_ssm`` has the same rule). ``m``: a ``ModelConfig`` / ``MixerFields`` (None: not
    checked). The one home of this rule: validation, the planner and ``apply_tp`` call it."""
    if tp == 1 or m is None:
        return
    x = linear_dims(m)
    if "gated_deltanet" in mixers:
        require(x["k_heads"] % tp == 0, f"gated_deltanet key heads (linear_heads {x['k_heads']}) are not "
                                        f"divisible by tp ({tp})")
    if "mamba2" in mixers:
        require(x["m_groups"] % tp == 0, f"mamba2 with tp ({tp}) > 1 needs mamba_groups ({x['m_groups']}) "
                                         f"divisible by tp: a B / C group's heads stay on one rank")


def check_ffn(ffn_hidden: int, tp: int) -> None:
    """The SwiGLU hidden size splits over ``tp`` (column-parallel w1 / w3, row-parallel w2)."""
    require(ffn_hidden % tp == 0, f"ffn hidden ({ffn_hidden}) is not divisible by tp ({tp})")


def check_moe(tp: int, expert_tp: int, expert_ffn: int = 0, shared_ffn: int = 0, seq_len: int = 0,
              cp: int = 1) -> None:
    """MoE under tp (``ndtrain.parallel.tp.moe_layers``): ``parallel.expert_tp`` splits each expert's
    hidden ``expert_ffn`` (1: whole experts; tp: over the attention tp; else over the folded expert
    mesh's own expert_tp ranks, ``ndtrain.mesh``); the shared experts' hidden ``shared_ffn``
    splits like a dense FFN; each tp rank routes a 1/tp piece of every cp chunk of the sequence,
    so ``seq_len`` splits into cp * lcm(2, tp) pieces when cp > 1 (the load-balanced layout's two
    chunks per rank), into tp pieces when cp = 1. Sizes of 0 are not checked (unknown)."""
    require(expert_tp >= 1, f"parallel.expert_tp ({expert_tp}) must be >= 1")
    if expert_tp > 1 and expert_ffn:
        require(expert_ffn % expert_tp == 0, f"expert hidden moe_ffn_hidden ({expert_ffn}) is not divisible by "
                                             f"expert_tp ({expert_tp}) (parallel.expert_tp splits every expert)")
    if tp == 1:
        return
    if shared_ffn:
        require(shared_ffn % tp == 0, f"shared-expert hidden ({shared_ffn}) is not divisible by tp ({tp})")
    pieces = cp * math.lcm(2 if cp > 1 else 1, tp)
    if seq_len:
        require(seq_len % pieces == 0, f"MoE under tp: seq_len ({seq_len}) is not divisible by {pieces} (each of "
                                       f"the tp ({tp}) ranks routes its own piece of every cp ({cp}) chunk)")
