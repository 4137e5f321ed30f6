"""Evaluate a layout (memory + step time -> MFU, tokens/s, days, cost) and search over layouts.

The search enumerates factorizations ``pp x dp_replicate x dp_shard x cp x tp`` of the GPU count
(tp and pp any divisor the model's shapes allow, tp within a node; cp powers of two; ep
for MoE models), ZeRO stages, checkpointing
policies, microbatch sizes and pipeline schedules; drops layouts that break a rule of ``ndtrain
train``'s validation (the same ``ndtrain.config.validate.check_axes``; ``include_unsupported`` keeps the
ones the planner can model, marked with the rule) or do not fit in memory on their peak pipeline
stage; ranks the rest by predicted MFU. For each mesh and microbatch it only keeps
the least recompute that fits per ZeRO stage (more recompute never runs faster), which keeps a
16,384-GPU search to a few thousand evaluations.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ndtrain.planner.ac_memory import recompute_attention_share
from ndtrain.planner.exec_mode import MODES
from ndtrain.planner.goodput import Goodput, goodput
from ndtrain.planner.hardware import Cluster
from ndtrain.planner.layout import Layout, Workload, check_layout, unsupported_rules
from ndtrain.planner.memory import MemoryEstimate, estimate_memory, recompute_fraction
from ndtrain.planner.timing import StepEstimate, estimate_step_time

LOSS_NAMES = {"bubble": "pipeline bubble", "recompute": "activation recompute",
              "tp_comm": "TP communication", "cp_comm": "CP communication",
              "ep_comm": "EP all-to-all", "pp_comm": "PP send/recv",
              "zero_comm": "ZeRO gather/scatter", "dp_comm": "data-parallel gradient sync",
              "optimizer": "optimizer step"}


@dataclass
class Plan:
    layout: Layout
    fits: bool
    memory: MemoryEstimate
    step: StepEstimate | None = None
    errors: list = field(default_factory=list)
    unsupported: list = field(default_factory=list)  # rules of ndtrain train's validation it breaks
    mfu: float = 0.0  # vs the bf16 dense peak under float8, else vs the dtype's peak
    hfu: float = 0.0
    mfu_vs_dtype_peak: float = 0.0  # vs the compute dtype's dense peak (= mfu unless float8)
    tokens_per_s: float = 0.0
    training_days: float = 0.0
    gpu_hours: float = 0.0
    cost: float = 0.0
    bottleneck: str = ""
    goodput: Goodput | None = None  # with failures: checkpoint interval, interruptions, lost time
    training_days_with_failures: float = 0.0
    gpu_hours_with_failures: float = 0.0

    def to_dict(self) -> dict:
        """The ``--json`` object of one layout (bytes, seconds, fractions)."""
        st = self.step
        link_of = {"tp_comm": "tp", "cp_comm": "cp", "ep_comm": "ep", "pp_comm": "pp",
                   "zero_comm": "dp", "dp_comm": "dp"}
        return {
            "layout": str(self.layout), "fits": self.fits, "errors": self.errors,
            "supported": not self.unsupported, "unsupported_rules": self.unsupported,
            "memory_per_stage_bytes": list(self.memory.per_stage) if self.memory else [],
            "memory_per_rank_bytes": self.memory.total if self.memory else None,
            "memory_breakdown_bytes": dict(self.memory.breakdown) if self.memory else {},
            "memory_capacity_bytes": self.memory.capacity if self.memory else None,
            "step_time_s": st.step_time_s if st else None,
            "step_breakdown_s": dict(st.parts) if st else {},
            "links": {k: (st.links.get(v) if st else None) for k, v in link_of.items()
                      if st and v in st.links},
            "microbatches": st.microbatches if st else None,
            "mfu": self.mfu, "mfu_vs_dtype_peak": self.mfu_vs_dtype_peak, "hfu": self.hfu, "tokens_per_s": self.tokens_per_s,
            "training_days": self.training_days, "gpu_hours": self.gpu_hours, "cost": self.cost,
            "bottleneck": self.bottleneck,
            "training_days_with_failures": self.training_days_with_failures,
            "gpu_hours_with_failures": self.gpu_hours_with_failures,
            "goodput": self.goodput.to_dict() if self.goodput else None,
        }


def evaluate(spec, cluster: Cluster, w: Workload, layout: Layout, with_time: bool = True,
             supported_only: bool = False) -> Plan:
    """Memory and (if it fits or ``with_time``) time of one layout. Never raises for a bad layout:
    the arithmetic rules it breaks are in ``plan.errors`` (``fits`` False); a layout the planner can
    model but ``ndtrain train`` rejects is evaluated and lists the rule in ``plan.unsupported``
    (``supported_only``: not evaluated, its rule in ``plan.errors``)."""
    try:
        lay = layout.resolve(cluster.gpus)
    except ValueError as e:
        return Plan(layout, False, None, errors=[str(e)])
    errs = check_layout(spec, cluster.gpus, w, lay, cluster.gpus_per_node, runtime=False)
    if errs:
        return Plan(lay, False, None, errors=errs)
    unsupported = unsupported_rules(spec, cluster.gpus, w, lay)
    if unsupported and supported_only:
        return Plan(lay, False, None, errors=unsupported)
    acc = cluster.accelerator
    mem = estimate_memory(spec, w, lay, acc.hbm_bytes, acc.runtime_reserve_bytes, acc.allocator_overhead)
    plan = Plan(lay, mem.fits, mem, unsupported=unsupported)
    if with_time:
        _add_time(plan, spec, cluster, w)
    return plan


def _add_time(plan: Plan, spec, cluster: Cluster, w: Workload) -> None:
    lay = plan.layout
    st = estimate_step_time(spec, cluster, w, lay)
    tokens = w.global_batch_seqs * w.seq_len
    flops = spec.flops_per_token(w.seq_len) * tokens
    rc = recompute_fraction(lay.ac, spec.n_layers) * flops / 3
    rc += recompute_attention_share(lay.ac, spec) * spec.attention_flops_per_token(w.seq_len) * tokens / 3
    denom = cluster.gpus * cluster.mfu_peak_flops_per_s * st.step_time_s
    plan.step = st
    plan.mfu, plan.hfu = flops / denom, (flops + rc) / denom
    plan.mfu_vs_dtype_peak = flops / (cluster.gpus * cluster.peak_flops_per_s * st.step_time_s)
    plan.tokens_per_s = tokens / st.step_time_s
    plan.training_days = w.train_tokens / plan.tokens_per_s / 86400
    plan.gpu_hours = plan.training_days * 24 * cluster.gpus
    plan.cost = plan.gpu_hours * cluster.price_per_gpu_hour
    plan.bottleneck = bottleneck(st)
    ckpt = sum(plan.memory.breakdown.get(k, 0) for k in ("params", "optimizer"))  # one rank's shard
    plan.goodput = goodput(plan.training_days * 86400, cluster.gpus, ckpt, w.mttf_hours,
                           w.checkpoint_save_s, w.checkpoint_load_s, w.restart_s)
    plan.training_days_with_failures = plan.goodput.wall_s / 86400
    plan.gpu_hours_with_failures = plan.training_days_with_failures * 24 * cluster.gpus


def bottleneck(st: StepEstimate) -> str:
    """The largest loss of a step (name and share of the step), or compute-bound."""
    losses = {k: v for k, v in st.parts.items() if k != "compute" and v > 0}
    if not losses:
        return "compute"
    k = max(losses, key=losses.get)
    share = losses[k] / st.step_time_s
    if share < 0.05:
        return "compute"
    link = {"tp_comm": "tp", "cp_comm": "cp", "ep_comm": "ep", "pp_comm": "pp",
            "dp_comm": "dp", "zero_comm": "dp"}.get(k)
    where = f" ({st.links[link]})" if link in st.links else ""
    return f"{LOSS_NAMES.get(k, k)}{where}: {share:.0%} of the step"


def _pow2_divisors(n: int, limit: int) -> list[int]:
    out, d = [], 1
    while d <= limit and n % d == 0:
        out.append(d)
        d *= 2
    return out


def divisors(n: int, limit: int) -> list[int]:
    """Every divisor of ``n`` up to ``limit``, ascending (not only powers of two: TP12, PP6)."""
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def tp_degrees(spec, cluster: Cluster) -> list[int]:
    """TP degrees within one node that split the query heads, the kv heads (split or replicated)
    and the SwiGLU hidden evenly (``parallel/tp/rules.py``; the vocabulary needs no rule: the head
    is padded to tp * ceil(V / tp) rows, ``parallel/tp/layers.py``)."""
    return [t for t in divisors(cluster.gpus, cluster.gpus_per_node)
            if spec.n_heads % t == 0 and (spec.n_kv_heads % t == 0 or t % spec.n_kv_heads == 0)
            and spec.ffn_hidden % t == 0]


def candidate_layouts(spec, cluster: Cluster, w: Workload, include_unsupported: bool = False,
                      mode: str = "compile") -> list[Layout]:
    """Meshes x schedules x microbatch sizes the search considers (ZeRO / AC chosen later): tp and
    pp any divisor the model's shapes allow (``tp_degrees``; pp up to the layer count, at most 128),
    cp a power of two for T >= 16K, ep a divisor of the expert count up to 64; every one in the
    execution ``mode`` (``exec_mode.MODES``)."""
    n, gpn = cluster.gpus, cluster.gpus_per_node
    seqs = w.global_batch_seqs
    out = []
    for tp in tp_degrees(spec, cluster):
        max_cp = max(1, w.seq_len // 8192) if w.seq_len >= 16384 else 1
        for cp in _pow2_divisors(n // tp, max_cp):
            for pp in divisors(n // (tp * cp), min(spec.n_layers, 128)):
                dp = n // (tp * cp * pp)
                if seqs % dp:
                    continue
                for rep in sorted({1, dp, max(1, dp * tp * cp // gpn) if dp * tp * cp > gpn else 1}):
                    if dp % rep:
                        continue
                    eps = [1] if not spec.is_moe else [e for e in divisors(n, 64)
                                                       if (dp // rep * cp) % e == 0
                                                       and spec.n_experts % e == 0]
                    for ep in eps:
                        out.extend(_with_knobs(Layout(tp=tp, cp=cp, pp=pp, dp_shard=dp // rep,
                                                      dp_replicate=rep, ep=ep, mode=mode), spec, seqs // dp,
                                               include_unsupported))
    return out


def _with_knobs(base: Layout, spec, local_seqs: int, include_unsupported: bool = False) -> list[Layout]:
    out = []
    for mb in (1, 2, 4, 8):
        if local_seqs % mb:
            continue
        m = local_seqs // mb
        if base.pp == 1:
            out.append(replace(base, microbatch=mb))
            continue
        out.append(replace(base, microbatch=mb, pp_schedule="1f1b"))
        out.append(replace(base, microbatch=mb, pp_schedule="zero_bubble"))
        if include_unsupported and 2 * base.pp <= spec.n_layers:
            out.append(replace(base, microbatch=mb, pp_schedule="dualpipev"))
        for v in (2, 4, 8):
            if base.pp * v <= spec.n_layers and m >= base.pp:
                out.append(replace(base, microbatch=mb, pp_schedule="interleaved",
                                       pp_virtual_stages=v))
    return out


AC_ORDER = ("none", "selective", "every:2", "full")


def search(spec, cluster: Cluster, w: Workload, top: int = 10, include_unsupported: bool = False,
           mode: str = "compile") -> list[Plan]:
    """Fitting layouts ranked by predicted MFU (ties: less memory first); at most ``top``. Only
    layouts ``ndtrain train`` accepts, unless ``include_unsupported`` (those carry their rule in
    ``plan.unsupported``; ``recommend`` never picks them). ``mode``: the execution mode of every
    candidate (compile | kernels | eager). Raises ValueError for another mode."""
    if mode not in MODES:
        raise ValueError(f"mode ({mode}) must be one of {', '.join(MODES)}")
    plans = []
    for base in candidate_layouts(spec, cluster, w, include_unsupported, mode):
        dp_cp = base.dp * base.cp
        stages = (0,) if dp_cp == 1 else (0, 1, 2, 3)
        for z in stages:
            for ac in AC_ORDER:
                plan = evaluate(spec, cluster, w, replace(base, zero_stage=z, ac=ac), with_time=False,
                                supported_only=not include_unsupported)
                if plan.errors:
                    break
                if plan.fits:
                    _add_time(plan, spec, cluster, w)
                    plans.append(plan)
                    break
    plans.sort(key=lambda p: (-round(p.mfu, 4), complexity(p.layout), p.memory.total))
    return plans[:top] if top else plans


def complexity(lay: Layout) -> tuple:
    """How much machinery a layout needs (fewer axes, lower ZeRO stage, less recompute first)."""
    axes = sum(getattr(lay, a) > 1 for a in ("tp", "cp", "pp", "ep")) + (lay.dp_replicate > 1 < lay.dp_shard)
    return (axes, lay.zero_stage, AC_ORDER.index(lay.ac) if lay.ac in AC_ORDER else 2, lay.pp_virtual_stages)


TIGHT = 0.95  # share of the device's memory above which a plan counts as tight


def recommend(plans: list, tolerance: float = 0.01) -> Plan | None:
    """The simplest plan within ``tolerance`` (relative) of the best predicted MFU, one with at least
    5% of the memory free first: the model is not more precise than that, and fewer moving parts
    are cheaper to run and debug."""
    plans = [p for p in plans if not p.unsupported]
    if not plans:
        return None
    best = max(p.mfu for p in plans)
    near = [p for p in plans if p.mfu >= best * (1 - tolerance)]
    # a plan within 5% of the device's memory loses to one with room (fragmentation, a longer
    # sequence in the batch): the estimate is not more precise than that either
    return min(near, key=lambda p: (p.memory.total > TIGHT * p.memory.capacity, complexity(p.layout), -p.mfu,
                                    p.memory.total))


def explain(plan: Plan, plans: list, spec, cluster: Cluster, w: Workload) -> list[str]:
    """Reasons for a recommendation: what bounds it, and why each parallel axis it uses is there."""
    gib = 2**30
    mem, st = plan.memory, plan.step
    state = sum(mem.breakdown.get(k, 0) for k in ("params", "grads", "optimizer"))
    act = mem.breakdown.get("activations", 0)
    out = [(f"predicted MFU {plan.mfu:.1%}, {plan.tokens_per_s:,.0f} tokens/s, step {st.step_time_s:.2f} s; "
            f"bounded by {plan.bottleneck}"),
           (f"memory {mem.total / gib:.1f} of {mem.capacity / gib:.1f} GiB per rank "
            f"(model state {state / gib:.1f}, activations {act / gib:.1f})")]
    losses = sorted(((v, k) for k, v in st.parts.items()
                     if k != "compute" and v >= 0.005 * st.step_time_s), reverse=True)[:3]
    out.append("largest losses: " + (", ".join(f"{LOSS_NAMES.get(k, k)} {v / st.step_time_s:.0%}"
                                               for v, k in losses) or "none above 0.5% of the step"))
    out.append(goodput_line(plan))
    fastest = max((p for p in plans if not p.unsupported), key=lambda p: p.mfu, default=plan)
    if fastest is not plan and fastest.mfu > plan.mfu:
        out.append(f"chosen over the fastest modelled layout ({fastest.layout.short()}, MFU {fastest.mfu:.2%}): "
                   f"within 1% of it the simplest wins (at least 5% of the memory free, then fewer parallel "
                   f"axes, a lower ZeRO stage, less recompute, fewer virtual stages), as the model is not more "
                   f"precise than that")
    lay = plan.layout
    for axis, what in (("tp", "tensor parallel"), ("pp", "pipeline parallel"), ("cp", "context parallel"),
                       ("ep", "expert parallel")):
        if getattr(lay, axis) == 1:
            continue
        alts = [p for p in plans if getattr(p.layout, axis) == 1]
        if alts:
            alt = max(alts, key=lambda p: p.mfu)
            out.append(f"{what} {getattr(lay, axis)}: the best layout without it ({alt.layout.short()}) "
                       f"reaches {alt.mfu:.1%} ({alt.bottleneck})")
        else:
            frugal = _frugal(plan.layout, axis, spec, cluster, w)
            need = f" (the leanest needs {frugal / gib:.0f} GiB)" if frugal else ""
            out.append(f"{what} {getattr(lay, axis)}: no layout without it fits in memory{need}")
    if lay.pp == lay.tp == lay.cp == 1:
        out.append(f"pure data parallel over {lay.dp} ranks"
                   + (f" with ZeRO-{lay.zero_stage}" if lay.zero_stage else " (DDP)")
                   + ": every other axis adds communication or a bubble without a memory need")
    elif lay.zero_stage == 0 and lay.dp > 1:
        out.append("no ZeRO sharding needed: the state fits replicated")
    return out


def goodput_line(plan: Plan) -> str:
    """The failure model's summary: interval, interruptions, days and GPU-hours with and without."""
    g = plan.goodput
    return (f"with failures (job MTTF {g.job_mttf_s / 3600:.1f} h, checkpoint save {g.save_s:.0f} s / load "
            f"{g.load_s:.0f} s, restart {g.restart_s:.0f} s): checkpoint every {g.interval_s / 60:.0f} min "
            f"(Young), {g.interruptions:,.0f} interruption{'' if round(g.interruptions) == 1 else 's'}, "
            f"{plan.training_days_with_failures:.1f} days "
            f"and {plan.gpu_hours_with_failures:,.0f} GPU-hours instead of {plan.training_days:.1f} and "
            f"{plan.gpu_hours:,.0f} (goodput {g.efficiency:.1%})")


def _frugal(lay: Layout, axis: str, spec, cluster: Cluster, w: Workload) -> float:
    """Memory of the leanest variant of ``lay`` with ``axis`` = 1 (ZeRO-3, full AC, microbatch 1)."""
    factor = getattr(lay, axis)
    alt = replace(lay, **{axis: 1}, dp_shard=lay.dp_shard * factor, zero_stage=3, ac="full", microbatch=1,
                  pp_schedule="1f1b" if axis == "pp" else lay.pp_schedule,
                  pp_virtual_stages=1 if axis == "pp" else lay.pp_virtual_stages)
    p = evaluate(spec, cluster, w, alt, with_time=False)
    return p.memory.total if p.memory else 0.0
