"""Layout rules of context parallel (ring: Liu 2023; Ulysses: Jacobs 2023); raise ``ConfigError``
naming the rule. Pure Python (``config.validate`` and the planner call them)."""
from __future__ import annotations

from ndtrain.errors import require
from ndtrain.mixer_spec import non_softmax_mixers

IMPLS = ("ring", "ulysses", "hybrid")  # hybrid: Ulysses inside cp_ulysses ranks, ring across
LAYOUTS = ("auto", "load_balanced", "contiguous")
# mixers whose cp rank continues from the previous rank's tokens (a state or a window): contiguous only
CONTIGUOUS_MIXERS = ("linear", "mamba2", "gated_deltanet", "sliding_window")


def resolve_layout(impl: str, layout: str, mixers: tuple[str, ...] = ()) -> str:
    """``auto`` -> load_balanced for ring, contiguous for Ulysses or any of ``CONTIGUOUS_MIXERS``."""
    if layout != "auto":
        return layout
    if set(mixers) & set(CONTIGUOUS_MIXERS):
        return "contiguous"
    return "load_balanced" if impl in ("ring", "hybrid") else "contiguous"


def check(cp: int, seq_len: int, impl: str = "ring", layout: str = "auto", n_heads: int = 1, tp: int = 1,
          sequence_parallel: bool = False, mla: bool = False, mtp: bool = False,
          seq_aux_loss: bool = False, capacity: bool = False, mixers: tuple[str, ...] = (),
          halo: int = 0, moe: bool = False, cp_ulysses: int = 1) -> None:
    """T cuts into the layout's chunks (2 cp or cp); Ulysses splits a tp rank's heads over cp; under sp a
    cp rank's T / cp tokens split over tp; ``CONTIGUOUS_MIXERS`` need the contiguous layout and T / cp
    >= ``halo``; unimplemented features are rejected. MoE seq-aux loss and capacity, MLA and MTP
    (with MoE too) are accepted: their counts are reduced over the cp ranks."""
    require(cp >= 1, f"parallel.cp ({cp}) must be >= 1")
    require(impl in IMPLS, f"parallel.cp_impl ({impl}) must be ring|ulysses|hybrid")
    check_hybrid(cp, impl, cp_ulysses, n_heads // max(tp, 1))
    require(layout in LAYOUTS, f"parallel.cp_layout ({layout}) must be auto|load_balanced|contiguous")
    if sequence_parallel:
        require(seq_len % (cp * tp) == 0,
                f"sequence parallel: tokens per cp rank (seq_len / cp = {seq_len // cp}) are not "
                f"divisible by tp ({tp})")
    if cp == 1:
        return
    resolved = resolve_layout(impl, layout, mixers)
    chunks = 2 * cp if resolved == "load_balanced" else cp
    require(impl != "ulysses" or resolved == "contiguous",
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
    """Tokens a cp rank takes from its predecessor for ``m``: swa_window - 1 (sliding window),
    linear_conv_kernel - 1 (mamba2 / gated_deltanet convolutions); 0 when none."""
    kinds = set(non_softmax_mixers(m))
    need = [m.swa_window - 1] if "sliding_window" in kinds else []
    if kinds & {"mamba2", "gated_deltanet"}:
        need.append(m.linear_conv_kernel - 1)
    return max(need, default=0)


def check_heads(heads_per_tp_rank: int, cp: int) -> None:
    """Ulysses scatters the query heads of a tp rank over the ``cp`` ranks (all-to-all on H)."""
    require(heads_per_tp_rank % cp == 0, f"Ulysses: heads per tp rank (n_heads / tp = {heads_per_tp_rank}) "
                                         f"are not divisible by cp ({cp})")


def check_hybrid(cp: int, impl: str, cp_ulysses: int, heads_per_tp_rank: int) -> None:
    """``parallel.cp_ulysses`` (hybrid's all-to-all degree) divides cp and the heads of a tp rank; it is
    only read by ``cp_impl=hybrid`` (1 elsewhere). The kv heads need no rule: they are replicated up to
    a multiple of cp_ulysses (``hybrid.kv_replicas``), so cp may exceed them."""
    require(cp_ulysses >= 1, f"parallel.cp_ulysses ({cp_ulysses}) must be >= 1")
    require(impl == "hybrid" or cp_ulysses == 1,
            f"parallel.cp_ulysses ({cp_ulysses}) is read only by cp_impl=hybrid (cp_impl is {impl})")
    if impl != "hybrid":
        return
    require(cp % cp_ulysses == 0, f"hybrid cp: cp_ulysses ({cp_ulysses}) does not divide cp ({cp})")
    require(heads_per_tp_rank % cp_ulysses == 0,
            f"hybrid cp: heads per tp rank (n_heads / tp = {heads_per_tp_rank}) are not divisible by "
            f"cp_ulysses ({cp_ulysses})")


def check_doc_balance(enabled: bool, document_mask: bool, cp: int, impl: str, layout: str) -> None:
    """``parallel.cp_doc_balance`` deals packed documents to the ring / hybrid cores by work: it needs
    ``data.document_mask``, cp > 1 and the load-balanced layout (the cores take any positions there)."""
    if not enabled:
        return
    require(document_mask, "parallel.cp_doc_balance needs data.document_mask=true (it balances documents)")
    require(cp > 1, f"parallel.cp_doc_balance needs cp > 1 (cp is {cp})")
    require(impl in ("ring", "hybrid") and layout == "load_balanced",
            f"parallel.cp_doc_balance needs cp_impl ring|hybrid with the load_balanced cp layout "
            f"(cp_impl {impl}, layout {layout})")
