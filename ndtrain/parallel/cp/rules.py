"""Layout rules of context parallel: ring attention (Liu 2023) and Ulysses (Jacobs 2023).

Called by ``ndtrain.config.validate`` and by the planner's feasibility check; raises ``ConfigError``
naming the rule. Pure Python.
"""
from __future__ import annotations

from ndtrain.errors import require
from ndtrain.mixer_spec import non_softmax_mixers

IMPLS = ("ring", "ulysses")
LAYOUTS = ("auto", "load_balanced", "contiguous")
# mixers whose cp rank continues from the previous rank's tokens (a state or a window): contiguous only
CONTIGUOUS_MIXERS = ("linear", "mamba2", "gated_deltanet", "sliding_window")


def resolve_layout(impl: str, layout: str, mixers: tuple[str, ...] = ()) -> str:
    """``auto`` -> load_balanced for ring (balances the causal mask), contiguous for Ulysses or
    when ``mixers`` (the pattern's non-softmax mixers) include one of ``CONTIGUOUS_MIXERS``."""
    if layout != "auto":
        return layout
    if set(mixers) & set(CONTIGUOUS_MIXERS):
        return "contiguous"
    return "load_balanced" if impl == "ring" else "contiguous"


def check(cp: int, seq_len: int, impl: str = "ring", layout: str = "auto", n_heads: int = 1, tp: int = 1,
          sequence_parallel: bool = False, mla: bool = False, mtp: bool = False,
          seq_aux_loss: bool = False, capacity: bool = False, mixers: tuple[str, ...] = (),
          halo: int = 0, moe: bool = False) -> None:
    """``seq_len`` (T) cuts into the layout's chunks (2 cp load-balanced, cp contiguous); Ulysses
    splits the heads of a tp rank over cp; under sequence parallel the T / cp tokens of a cp rank
    split over tp; features not implemented under cp > 1 are rejected. ``seq_aux_loss`` and
    ``capacity`` (MoE) are accepted: their per-sequence loads and capacity counts are reduced over
    the cp ranks (``ndtrain.parallel.cp.moe_shards``), so they equal the single process's.
    ``mixers`` (the pattern's non-softmax mixers) in ``CONTIGUOUS_MIXERS`` need the contiguous
    layout and a rank's T / cp tokens to cover ``halo``, the left context they take from the
    previous rank only (max of swa_window - 1 and linear_conv_kernel - 1). ``mla`` and ``mtp``
    run under ring and Ulysses, ``mtp`` with ``moe`` too: the MTP depths run padded to the full
    sequence and their MoE layers mask the padded tail out of routing and statistics
    (``MoE.token_mask``)."""
    require(cp >= 1, f"parallel.cp ({cp}) must be >= 1")
    require(impl in IMPLS, f"parallel.cp_impl ({impl}) must be ring|ulysses")
    require(layout in LAYOUTS, f"parallel.cp_layout ({layout}) must be auto|load_balanced|contiguous")
    if sequence_parallel:
        require(seq_len % (cp * tp) == 0,
                f"sequence parallel: tokens per cp rank (seq_len / cp = {seq_len // cp}) are not "
                f"divisible by tp ({tp})")
    if cp == 1:
        return
    resolved = resolve_layout(impl, layout, mixers)
    chunks = 2 * cp if resolved == "load_balanced" else cp
    require(impl == "ring" or resolved == "contiguous",
            "parallel.cp_impl=ulysses needs cp_layout contiguous (or auto)")
    require(seq_len % chunks == 0, f"seq_len ({seq_len}) is not divisible by the {chunks} chunks of the "
                                   f"{resolved} cp layout (cp={cp})")
    if impl == "ulysses":
        check_heads(n_heads // tp, cp)
    ordered = sorted(set(mixers) & set(CONTIGUOUS_MIXERS))
    require(not ordered or resolved == "contiguous",
            f"model.layer_pattern with {ordered} under cp ({cp}) > 1 needs parallel.cp_layout contiguous (or "
            "auto): each rank continues the previous rank's state / window")
    require(not ordered or seq_len // cp >= halo,
            f"cp: a rank's {seq_len // cp} tokens (seq_len / cp) are fewer than the {halo} of left context "
            f"that {ordered} take from the previous rank (swa_window - 1, linear_conv_kernel - 1)")
    # MLA: ring / Ulysses cores take its (d_n + d_r)-wide q / k and d_v-wide v. MTP: shifted ids
    # cross ranks (cp.mtp_shift), the depths run padded to the full sequence, MoE masks the padding


def left_context(m) -> int:
    """Tokens a cp rank takes from its predecessor for the model ``m`` (a ``ModelConfig`` or the
    planner's ``MixerFields``): swa_window - 1 for sliding-window layers, linear_conv_kernel - 1
    for the short convolutions of mamba2 / gated_deltanet; 0 when none."""
    kinds = set(non_softmax_mixers(m))
    need = [m.swa_window - 1] if "sliding_window" in kinds else []
    if kinds & {"mamba2", "gated_deltanet"}:
        need.append(m.linear_conv_kernel - 1)
    return max(need, default=0)


def check_heads(heads_per_tp_rank: int, cp: int) -> None:
    """Ulysses scatters the query heads of a tp rank over the ``cp`` ranks (all-to-all on H)."""
    require(heads_per_tp_rank % cp == 0, f"Ulysses: heads per tp rank (n_heads / tp = {heads_per_tp_rank}) "
                                         f"are not divisible by cp ({cp})")
