"""Layout rules of pipeline parallel (GPipe, 1F1B, interleaved 1F1B of Narayanan 2021, ZB-H1,
DualPipeV of DeepSeek-V3 2024).

Called by ``ndtrain.config.validate`` and by the planner's feasibility check; raises ``ConfigError``
naming the rule. Pure Python.
"""
from __future__ import annotations

from ndtrain.errors import require

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble", "dualpipev")


def check(pp: int, n_layers: int, pp_schedule: str = "1f1b", pp_virtual_stages: int = 1,
          pp_microbatches: int = 0, activation_checkpoint: str = "none", moe: bool = False,
          mtp: bool = False, end_stages_may_hold_no_block: bool = False) -> None:
    """Schedule name; ``pp_virtual_stages`` (v) > 1 exactly for the interleaved schedule; every one
    of the pp * v virtual stages holds a block. ``end_stages_may_hold_no_block``: the first / last
    virtual stage may hold only the embedding / head (Llama 3's 126 blocks in 16 x 8 chunks) --
    the planner models that layout, ndtrain's stage builder does not, so validation passes False.
    MoE and MTP models run under every schedule (each stage backpropagates its own MoE layers'
    auxiliary losses; MTP sits with the head); ``moe`` / ``mtp`` are kept for callers and no longer
    restrict anything. DualPipeV holds 2 chunks per rank (``pp_virtual_stages`` stays 1), so it
    needs n_layers >= 2 pp, and >= 2 pp microbatches (``check_microbatches``)."""
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
        return
    if pp_schedule == "dualpipev":  # rank r holds stages r and 2 pp - 1 - r
        v = 2
        require(pp_microbatches == 0 or pp_microbatches >= 2 * pp,
                f"pp_schedule=dualpipev needs pp_microbatches ({pp_microbatches}) >= 2 * pp ({2 * pp})")
    spare = 2 if end_stages_may_hold_no_block and v > 1 else 0
    require(pp_schedule != "dualpipev" or n_layers >= 2 * pp,
            f"n_layers ({n_layers}) < 2 * pp ({2 * pp}): pp_schedule=dualpipev holds 2 chunks per rank, "
            "each needs at least one block")
    require(n_layers + spare >= pp * v, f"n_layers ({n_layers}) < pp * pp_virtual_stages ({pp * v})"
                                        + (" - 2" if spare else "") + ": every pipeline stage needs at "
                                        "least one block")
    if pp_schedule in ("zero_bubble", "dualpipev"):
        require(activation_checkpoint == "none", f"pp_schedule={pp_schedule} needs activation_checkpoint=none "
                                                 "(its W pass reuses the activations its B pass kept)")


def check_microbatches(pp: int, pp_schedule: str, n_micro: int) -> None:
    """DualPipeV's warm-up and cool-down need m >= 2 pp microbatches per step (its phase of
    overlapped pairs runs m - 2 pp + r + 1 times on rank r); other schedules take any m >= 1."""
    if pp > 1 and pp_schedule == "dualpipev":
        require(n_micro >= 2 * pp, f"pp_schedule=dualpipev needs >= 2 * pp ({2 * pp}) microbatches per step "
                                   f"(got {n_micro}: local batch / micro_batch_size, or pp_microbatches)")


OVERLAP_MODES = ("auto", "true", "false")


def overlap_blockers(pp: int, pp_schedule: str, tp: int = 1, cp: int = 1, zero_stage: int = 0,
                     activation_checkpoint: str = "none", compiled: bool = False,
                     device: str = "cpu") -> list[str]:
    """Why DualPipeV's overlapped F&B pairs cannot run in two threads (``parallel.pp_overlap``,
    ``ndtrain.parallel.pp.runtime``); empty when they can. Every collective of a pair must be on a
    group only one of its threads uses: expert parallel's forward all-to-alls on ``ep``, its
    backward ones on the twin ``ep_bwd``, pipeline sends from the main thread only. Tensor and
    context parallel put forward and backward collectives on one group (``tp`` / ``cp``); ZeRO-3
    all-gathers on one group in both; a recompute in the backward thread would re-run forwards that
    read per-microbatch module state (MoE token masks, MTP ids); torch.compile is not run from two
    threads at once; on CUDA both threads would queue on one stream (the overlap needs streams)."""
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
    """``parallel.pp_overlap`` is auto | true | false, and ``true`` only where every condition of
    ``overlap_blockers`` holds (the error names the first that fails)."""
    mode = str(pp_overlap).lower()
    require(mode in OVERLAP_MODES, f"parallel.pp_overlap ({pp_overlap}) must be auto|true|false")
    if mode == "true":
        why = overlap_blockers(pp, pp_schedule, tp, cp, zero_stage, activation_checkpoint, compiled, device)
        require(not why, f"parallel.pp_overlap=true needs {why[0] if why else ''}")


def resolve_overlap(pp_overlap, pp: int, pp_schedule: str, tp: int = 1, cp: int = 1, zero_stage: int = 0,
                    activation_checkpoint: str = "none", compiled: bool = False, device: str = "cpu") -> bool:
    """Whether the runtime overlaps DualPipeV's pairs: ``true`` (checked: raises ConfigError like
    ``check_overlap``), ``auto`` where no blocker holds, never for ``false``."""
    args = (pp, pp_schedule, tp, cp, zero_stage, activation_checkpoint, compiled, device)
    check_overlap(pp_overlap, *args)
    return str(pp_overlap).lower() != "false" and not overlap_blockers(*args)


def split_layers(blocks: list[float], n_stages: int, first_extra: float = 0.0,
                 last_extra: float = 0.0) -> list[list[int]]:
    """Cut ``blocks`` (per-block costs) into ``n_stages`` contiguous non-empty runs (the trainer's
    ``parallel/pp/stage.py`` and the planner both split with this); stage 0 also
    costs ``first_extra`` and the last stage ``last_extra``. Minimises the largest stage cost, then
    the sum of squared stage costs (deterministic). Raises ValueError if len(blocks) < n_stages."""
    n = len(blocks)
    if n < n_stages:
        raise ValueError(f"n_layers ({n}) < pipeline stages pp * v ({n_stages})")
    pre = [0.0]
    for c in blocks:
        pre.append(pre[-1] + c)

    def cost(s: int, i: int, j: int) -> float:  # stage s holds blocks i..j-1
        return (pre[j] - pre[i] + (first_extra if s == 0 else 0.0)
                + (last_extra if s == n_stages - 1 else 0.0))

    inf = (float("inf"), float("inf"))
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]  # best[s][j]: first j blocks in s stages
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for s in range(1, n_stages + 1):
        for j in range(s, n - (n_stages - s) + 1):
            for i in range(s - 1, j):
                prev = best[s - 1][i]
                if prev == inf:
                    continue
                c = cost(s - 1, i, j)
                cand = (max(prev[0], c), prev[1] + c * c)
                if cand < best[s][j]:
                    best[s][j], cut[s][j] = cand, i
    runs, j = [], n
    for s in range(n_stages, 0, -1):
        i = cut[s][j]
        runs.append(list(range(i, j)))
        j = i
    return runs[::-1]


def inert_settings(pp: int, pp_schedule: str, pp_virtual_stages: int) -> list[str]:
    """Pipeline settings a valid config gives that have no effect: with pp = 1 there is one stage,
    which runs its microbatches forward then backward whatever the schedule. Returns one sentence
    per such setting (printed as a note before training; not an error, so a preset written for a
    pipeline still runs scaled down to one stage)."""
    if pp > 1:
        return []
    notes = []
    if pp_schedule != "1f1b":
        notes.append(f"parallel.pp_schedule={pp_schedule} has no effect with pp=1 (one stage runs its "
                     "microbatches forward then backward)")
    if pp_virtual_stages > 1:
        notes.append(f"parallel.pp_virtual_stages={pp_virtual_stages} has no effect with pp=1")
    return notes
