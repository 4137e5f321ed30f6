"""Why no layout is proposed: which constraint fails, for how many meshes and for the closest.

The search (``search.candidate_layouts``) skips meshes that break the model's or the batch's
divisibility rules before it evaluates memory, so "nothing fits in memory" can be wrong: no
candidate may have been generated at all (e.g. 6,144 GPUs and 2,048 sequences per step, where the
factor 3 of the GPU count has to go into TP or PP). ``diagnose`` enumerates the plain meshes
``tp x pp x dp_shard`` over all divisors (tp within a node, pp up to the layer count), each in its
leanest setting (ZeRO-3, full recompute, microbatch 1, 1F1B), runs the same ``check_layout`` rules
and memory model, and says what failed. Pure Python.
"""
from __future__ import annotations

import re
from collections import Counter

from ndtrain.config.validate import seq_len_rule
from ndtrain.planner.hardware import Cluster
from ndtrain.planner.layout import Layout, Workload
from ndtrain.planner.search import divisors, evaluate

GiB = 2**30


def _rule(msg: str) -> str:
    """An error message with its numbers blanked: the rule it names, for counting."""
    return re.sub(r"\d+", "N", msg)


def leanest_meshes(spec, cluster: Cluster, w: Workload) -> list[Layout]:
    """Every ``tp x pp x dp_shard`` mesh (tp | gpus_per_node-bounded divisors, pp up to the layer
    count; MoE: ep the largest divisor of the expert count that divides dp_shard), leanest knobs."""
    n, out = cluster.gpus, []
    for tp in divisors(n, cluster.gpus_per_node):
        for pp in divisors(n // tp, spec.n_layers):
            dp = n // (tp * pp)
            ep = max((e for e in divisors(dp, 64) if spec.n_experts % e == 0), default=1) if spec.is_moe else 1
            out.append(Layout(tp=tp, pp=pp, dp_shard=dp, ep=1, zero_stage=3 if dp > 1 else 0,
                              ac="full", microbatch=1, pp_schedule="1f1b"))
            if ep > 1:  # ndtrain's expert parallel runs without ZeRO
                out.append(Layout(tp=tp, pp=pp, dp_shard=dp, ep=ep, ac="full", microbatch=1))
    return out


def diagnose(spec, cluster: Cluster, w: Workload, closest: int = 3) -> list[str]:
    """Lines explaining an empty search: a rule no layout can meet first (the sequence length),
    then the rules that rejected the meshes (with counts), the closest meshes and their
    violations, or the leanest valid mesh's memory if none fits."""
    head = []
    if spec.max_seq_len and w.seq_len > spec.max_seq_len:
        head.append(f"every layout: {seq_len_rule(w.seq_len, spec.max_seq_len)} (ndtrain train rejects it: "
                    "raise model.max_seq_len, the RoPE table, or lower --seq-len)")
    return head + _diagnose(spec, cluster, w, closest)


def _diagnose(spec, cluster: Cluster, w: Workload, closest: int) -> list[str]:
    plans = [evaluate(spec, cluster, w, lay, with_time=False) for lay in leanest_meshes(spec, cluster, w)]
    for p in plans:  # the search proposes only what ndtrain train accepts: its rules count here
        p.errors = p.errors + p.unsupported
    valid = [p for p in plans if not p.errors]
    lines = []
    if valid:
        lean = min(valid, key=lambda p: p.memory.total)
        if lean.fits:  # the search's own filters (e.g. its microbatch set) left it out
            msg = (f"a valid layout fits but the search did not generate it: {lean.layout.short()} "
                   f"({lean.memory.total / GiB:.1f} GiB); evaluate it with --layout")
            return [msg]
        bd = ", ".join(f"{k} {v / GiB:.1f}" for k, v in lean.memory.breakdown.items() if v)
        lines.append(f"{len(valid)} of {len(plans)} meshes are valid but none fits in memory; the leanest, "
                     f"{lean.layout.short()}, needs {lean.memory.total / GiB:.1f} GiB of "
                     f"{lean.memory.capacity / GiB:.1f} ({bd})")
        rejected = [p for p in plans if p.errors]
        if rejected:  # the meshes that might have fitted: what ruled them out
            counts, example = _rule_counts(rejected)
            lines.append(f"the other {len(rejected)} break a rule:")
            lines += [f"  {c} mesh{'es' if c > 1 else ''} ({_meshes(rejected, rule)}): {example[rule]}"
                      for rule, c in counts.most_common(4)]
        return lines
    counts, example = _rule_counts(plans)
    lines.append(f"no valid layout: all {len(plans)} meshes tp x pp x dp_shard of {cluster.gpus} GPUs "
                 f"(tp up to {cluster.gpus_per_node} per node) break a rule:")
    for rule, c in counts.most_common(4):
        lines.append(f"  {c} meshes: {example[rule]}")
    lines.append("closest (fewest violated rules):")
    for p in sorted(plans, key=lambda p: (len(p.errors), p.layout.tp * p.layout.pp))[:closest]:
        lines.append(f"  {p.layout.short()}: " + "; ".join(p.errors))
    return lines


def _rule_counts(plans) -> tuple[Counter, dict]:
    """(meshes per violated rule, an example message per rule) over ``plans``."""
    counts = Counter(r for p in plans for r in {_rule(e) for e in p.errors})
    example = {}
    for p in plans:
        for e in p.errors:
            example.setdefault(_rule(e), e)
    return counts, example


def _meshes(plans, rule: str, most: int = 3) -> str:
    names = [p.layout.short().split(" z")[0] for p in plans if any(_rule(e) == rule for e in p.errors)]
    return ", ".join(names[:most]) + (", ..." if len(names) > most else "")
