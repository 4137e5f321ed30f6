"""Layout rules of pipeline parallel (GPipe, 1F1B, interleaved (Narayanan 2021), ZB-H1, DualPipeV
(DeepSeek-V3 2024)); raise ``ConfigError`` naming the rule. Pure Python."""
from __future__ import annotations

from ndtrain.errors import require
from ndtrain.parallel.pp.layout import check_layout, split_layers  # noqa: F401  (the planner imports it here)

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble", "dualpipev")


def check(pp: int, n_layers: int, pp_schedule: str = "1f1b", pp_virtual_stages: int = 1,
          pp_microbatches: int = 0, activation_checkpoint: str = "none", moe: bool = False,
          mtp: bool = False, end_stages_may_hold_no_block: bool = False, layout: str = "",
          mtp_depth: int = 0) -> None:
    """Schedule name; v > 1 exactly for interleaved; ``layout`` (``parallel.pp_layout``) set: it fits
    the pp * v virtual stages, n_layers and ``mtp_depth`` (``layout.check_layout``); else each stage
    but the first and the last holds a block (those two may hold only the embedding / the head,
    Llama 3's layout), and the planner's ``end_stages_may_hold_no_block`` keeps its v > 1 form;
    DualPipeV without a layout needs n_layers >= 2 pp. ``moe`` / ``mtp`` restrict nothing."""
    v = pp_virtual_stages
    require(pp >= 1, f"parallel.pp ({pp}) must be >= 1")
    require(pp_schedule in SCHEDULES, f"parallel.pp_schedule ({pp_schedule}) must be "
                                      "gpipe|1f1b|interleaved|zero_bubble|dualpipev")
    require(pp_microbatches >= 0, f"parallel.pp_microbatches ({pp_microbatches}) must be >= 0")
    require(v >= 1, f"parallel.pp_virtual_stages ({v}) must be >= 1")
    if pp_schedule == "interleaved":
        require(v >= 2, f"pp_schedule=interleaved needs pp_virtual_stages >= 2 (got {v})")
    else:
        require(v == 1, f"pp_virtual_stages ({v}) > 1 needs pp_schedule=interleaved (got {pp_schedule})")
    if pp == 1:
        if layout:  # one stage: the whole model ("Et*NL"), else the layout is meant for another pp
            check_layout(layout, 1, n_layers, mtp_depth)
        return
    if pp_schedule == "dualpipev":  # rank r holds stages r and 2 pp - 1 - r
        v = 2
        require(pp_microbatches == 0 or pp_microbatches >= 2 * pp,
                f"pp_schedule=dualpipev needs pp_microbatches ({pp_microbatches}) >= 2 * pp ({2 * pp})")
    if layout:
        check_layout(layout, pp * v, n_layers, mtp_depth)
    else:
        _check_default_split(pp, n_layers, pp_schedule, v, end_stages_may_hold_no_block)
    if pp_schedule in ("zero_bubble", "dualpipev"):
        require(activation_checkpoint == "none", f"pp_schedule={pp_schedule} needs activation_checkpoint=none "
                                                 "(its W pass reuses the activations its B pass kept)")


def _check_default_split(pp: int, n_layers: int, pp_schedule: str, v: int, planner: bool) -> None:
    """The balanced split's room: DualPipeV a block per chunk; else n_layers >= pp * v - 2 (the
    end stages may hold only the embedding / head; the planner's form: only with v > 1)."""
    require(pp_schedule != "dualpipev" or n_layers >= 2 * pp,
            f"n_layers ({n_layers}) < 2 * pp ({2 * pp}): pp_schedule=dualpipev holds 2 chunks per rank, "
            "each needs at least one block")
    spare = 0 if planner and v == 1 else 2
    require(n_layers + spare >= pp * v, f"n_layers ({n_layers}) < pp * pp_virtual_stages ({pp * v})"
                                        + (" - 2" if spare else "") + ": every pipeline stage"
                                        + (" but the first and the last (which may hold only the embedding"
                                           " / the head)" if spare else "") + " needs at least one block")


def check_microbatches(pp: int, pp_schedule: str, n_micro: int) -> None:
    """DualPipeV needs m >= 2 pp microbatches (its pair phase runs m - 2 pp + r + 1 times); others m >= 1."""
    if pp > 1 and pp_schedule == "dualpipev":
        require(n_micro >= 2 * pp, f"pp_schedule=dualpipev needs >= 2 * pp ({2 * pp}) microbatches per step "
                                   f"(got {n_micro}: local batch / micro_batch_size, or pp_microbatches)")


OVERLAP_MODES = ("auto", "true", "false")


def overlap_blockers(pp: int, pp_schedule: str, tp: int = 1, cp: int = 1, zero_stage: int = 0,
                     activation_checkpoint: str = "none", compiled: bool = False,
                     device: str = "cpu") -> list[str]:
    """Why DualPipeV's pairs cannot run in two threads; empty when they can. Each collective of a pair
    must be on a group one thread uses: tp / cp and ZeRO-3 share groups between F and B; a backward
    recompute would reread per-microbatch state; torch.compile is not run from two threads; on CUDA
    both threads would queue on one stream."""
    out = []
    if pp < 2 or pp_schedule != "dualpipev":
        out.append(f"pp_schedule=dualpipev with pp >= 2 (got {pp_schedule}, pp={pp}): only DualPipeV has pairs")
    if tp > 1:
        out.append(f"tp ({tp}) == 1: tensor-parallel collectives run in forward and backward on one group")
    if cp > 1:
        out.append(f"cp ({cp}) == 1: context-parallel collectives run in forward and backward on one group")
    if zero_stage > 2:
        out.append(f"zero_stage ({zero_stage}) <= 2: ZeRO-3 all-gathers in forward and backward on one group")
    if activation_checkpoint != "none":
        out.append(f"activation_checkpoint=none (got {activation_checkpoint}): a recompute in the backward "
                   "thread would re-run forwards that read per-microbatch module state")
    if compiled:
        out.append("training.compile=false: compiled code is not run from two threads at once")
    if device == "cuda":
        out.append("training.device=cpu: on CUDA the two threads would queue on one stream")
    return out


def check_overlap(pp_overlap, pp: int, pp_schedule: str, tp: int = 1, cp: int = 1, zero_stage: int = 0,
                  activation_checkpoint: str = "none", compiled: bool = False, device: str = "cpu") -> None:
    """``parallel.pp_overlap`` is auto | true | false; ``true`` only with no blocker (the error names the
    first)."""
    mode = str(pp_overlap).lower()
    require(mode in OVERLAP_MODES, f"parallel.pp_overlap ({pp_overlap}) must be auto|true|false")
    if mode == "true":
        why = overlap_blockers(pp, pp_schedule, tp, cp, zero_stage, activation_checkpoint, compiled, device)
        require(not why, f"parallel.pp_overlap=true needs {why[0] if why else ''}")


def resolve_overlap(pp_overlap, pp: int, pp_schedule: str, tp: int = 1, cp: int = 1, zero_stage: int = 0,
                    activation_checkpoint: str = "none", compiled: bool = False, device: str = "cpu",
                    all_to_all: bool = True) -> bool:
    """Whether the pairs overlap: ``true`` (raises ConfigError like ``check_overlap``), ``auto`` without
    blockers and when a pair has an expert all-to-all to hide (``all_to_all``: an MoE model with ep > 1).
    A dense pair is compute only: its two threads would share the rank's cores and gain nothing (on
    two 1-thread CPU ranks the sequential pairs ran faster), so ``auto`` runs it sequentially."""
    args = (pp, pp_schedule, tp, cp, zero_stage, activation_checkpoint, compiled, device)
    check_overlap(pp_overlap, *args)
    mode = str(pp_overlap).lower()
    if mode == "false" or overlap_blockers(*args):
        return False
    return mode == "true" or all_to_all


def inert_settings(pp: int, pp_schedule: str, pp_virtual_stages: int, pp_layout: str = "") -> list[str]:
    """One sentence per pipeline setting without effect (pp = 1 runs one stage whatever the schedule),
    printed as a note before training, not an error."""
    if pp > 1:
        return []
    notes = []
    if pp_schedule != "1f1b":
        notes.append(f"parallel.pp_schedule={pp_schedule} has no effect with pp=1 (one stage runs its "
                     "microbatches forward then backward)")
    if pp_virtual_stages > 1:
        notes.append(f"parallel.pp_virtual_stages={pp_virtual_stages} has no effect with pp=1")
    if pp_layout:
        notes.append(f"parallel.pp_layout={pp_layout} has no effect with pp=1 (one stage holds the whole model)")
    return notes
