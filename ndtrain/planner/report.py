"""Human-readable output: the ranked table, a markdown report, and two PNG figures.

``write_report(dir, ...)`` writes ``plan.md`` (inputs, ranked layouts, recommendation with reasons,
memory and step-time breakdowns), ``memory.png`` (per-rank memory breakdown of the top layouts as
stacked bars against the device capacity) and ``timeline.png`` (one step of the recommended
layout: the critical path's compute / exposed communication / bubble segments, and underneath the
communication that runs hidden behind compute). Matplotlib runs on the Agg backend (no display).
"""
from __future__ import annotations

from pathlib import Path

GiB = 2**30
MEM_COLORS = {"params": "#4c72b0", "grads": "#55a868", "optimizer": "#c44e52", "activations": "#8172b2",
              "zero3_buffers": "#ccb974", "param_casts": "#64b5cd", "logits": "#dd8452",
              "runtime_reserve": "#999999"}
TIME_COLORS = {"compute": "#4c72b0", "recompute": "#8172b2", "tp_comm": "#dd8452", "cp_comm": "#c44e52",
               "ep_comm": "#937860", "pp_comm": "#da8bc3", "zero_comm": "#ccb974", "bubble": "#dddddd",
               "dp_comm": "#55a868", "optimizer": "#64b5cd"}


def format_table(plans: list, recommended=None) -> str:
    """A fixed-width table of plans (one line each); ``*`` marks the recommended one, ``!`` one
    ``ndtrain train`` rejects (its rule follows the table)."""
    head = f"{'':1} {'#':>3} {'layout':<52} {'mem GiB':>8} {'step s':>8} {'MFU':>6} {'tok/s':>11} " \
           f"{'days':>8}  bottleneck"
    lines = [head, "-" * len(head)]
    for i, p in enumerate(plans, 1):
        mark = "*" if p is recommended else ("!" if getattr(p, "unsupported", None) else "")
        mem = f"{p.memory.total / GiB:8.1f}" if p.memory else f"{'-':>8}"
        step = f"{p.step.step_time_s:8.2f}" if p.step else f"{'-':>8}"
        tail = p.bottleneck if p.fits else ("does not fit" if p.memory else "; ".join(p.errors))
        lines.append(f"{mark:1} {i:>3} {p.layout.short():<52} {mem} {step} {p.mfu:6.1%} "
                     f"{p.tokens_per_s:11,.0f} {p.training_days:8.1f}  {tail}")
    marked = [(i, p) for i, p in enumerate(plans, 1) if getattr(p, "unsupported", None)]
    if marked:
        lines.append("! not accepted by ndtrain train (modelled only):")
        lines += [f"  {i}: {p.unsupported[0]}" for i, p in marked]
    return "\n".join(lines)


def markdown_report(plans: list, recommended, reasons: list, spec, cluster, w) -> str:
    acc = cluster.accelerator
    out = ["# ndtrain plan", "",
           (f"**Model** {spec.name}: {spec.params_total / 1e9:.2f}B parameters "
            f"({spec.params_active / 1e9:.2f}B active), {spec.n_layers} layers, width {spec.dim}, "
            f"{spec.flops_per_token(w.seq_len):.3g} FLOPs/token at T = {w.seq_len}."),
           (f"**Cluster** {cluster.gpus} x {acc.name} ({cluster.gpus_per_node} per node, "
            f"{cluster.peak_flops_per_s / 1e12:.0f} TFLOP/s {cluster.dtype}, {acc.hbm_bytes / GiB:.1f} GiB, "
            f"intra-node {cluster.intra_node_bytes_per_s / 1e9:.0f} GB/s, inter-node "
            f"{cluster.inter_node_bytes_per_s / 1e9:.0f} GB/s per GPU per direction; "
            f"${cluster.price_per_gpu_hour:.2f}/GPU-hour)."),
           (f"**Workload** {w.global_batch_tokens:,} tokens per step, {w.train_tokens:.3g} tokens in total, "
            f"precision convention `{w.precision}`."), ""]
    if recommended is not None:
        r = recommended
        out += ["## Recommendation", "", f"`{r.layout}`", ""] + [f"- {x}" for x in reasons]
        cost = f"Training time {r.training_days:.1f} days, {r.gpu_hours:,.0f} GPU-hours, ${r.cost:,.0f}."
        out += ["", cost, "", "![memory](memory.png)", "", "![timeline](timeline.png)", ""]
        out += ["| memory part | GiB |", "|---|---:|"]
        out += [f"| {k} | {v / GiB:.2f} |" for k, v in r.memory.breakdown.items()]
        out += [f"| **total** | **{r.memory.total / GiB:.2f}** |", "", "| step part | s |", "|---|---:|"]
        out += [f"| {k} | {v:.3f} |" for k, v in r.step.parts.items() if v > 0]
        out += [f"| **step** | **{r.step.step_time_s:.3f}** |", ""]
    out += ["## Ranked layouts", "", "```", format_table(plans, recommended), "```", ""]
    return "\n".join(out)


def plot_memory(plans: list, path: Path, capacity: float) -> None:
    """Stacked horizontal bars of the per-rank memory breakdown for each plan."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plans = [p for p in plans if p.memory][:12]
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(plans) + 1.6))
    for i, p in enumerate(plans):
        left = 0.0
        for k, v in p.memory.breakdown.items():
            ax.barh(i, v / GiB, left=left, color=MEM_COLORS.get(k, "#333333"),
                    label=k if i == 0 or k not in {lb for lb in ax.get_legend_handles_labels()[1]} else None)
            left += v / GiB
    ax.axvline(capacity / GiB, color="black", linestyle="--", linewidth=1, label="capacity")
    ax.set_yticks(range(len(plans)), [p.layout.short() for p in plans], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("GiB per rank (peak stage)")
    ax.set_title("Per-rank memory breakdown")
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    ax.legend(uniq.values(), uniq.keys(), fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_timeline(plan, path: Path) -> None:
    """One optimizer step of ``plan``: critical-path segments, and hidden communication below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    st = plan.step
    fig, ax = plt.subplots(figsize=(12, 2.8))
    left = 0.0
    for k, v in st.parts.items():
        if v <= 0:
            continue
        ax.barh(1, v, left=left, color=TIME_COLORS.get(k, "#333333"), edgecolor="white", label=k)
        if v / st.step_time_s > 0.06:
            ax.text(left + v / 2, 1, k.replace("_", " "), ha="center", va="center", fontsize=7)
        left += v
    hidden = _hidden_comm(plan)
    left = 0.0
    for k, v in hidden.items():
        ax.barh(0, v, left=left, color=TIME_COLORS.get(k, "#333333"), alpha=0.45, edgecolor="white")
        if v / st.step_time_s > 0.06:
            ax.text(left + v / 2, 0, f"{k.replace('_', ' ')} (hidden)", ha="center", va="center", fontsize=7)
        left += v
    ax.set_yticks([0, 1], ["overlapped\ncommunication", "critical path"], fontsize=8)
    ax.set_xlabel("seconds")
    ax.set_title(f"{plan.layout.short()}: step {st.step_time_s:.2f} s, MFU {plan.mfu:.1%}", fontsize=9)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(dict(zip(labels, handles)).values(), dict(zip(labels, handles)).keys(), fontsize=7,
              loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _hidden_comm(plan) -> dict:
    """Per-step communication seconds that the model assumes overlapped (raw minus exposed)."""
    st = plan.step
    raw, m, n = st.raw_comm, st.microbatches, st.stage_layers
    total = {"tp_comm": m * n * (raw["tp_fwd"] + raw["tp_bwd"]),
             "cp_comm": m * n * (raw["cp_fwd"] + raw["cp_bwd"]),
             "zero_comm": m * (raw["zero_fwd"] + raw["zero_bwd"]),
             "dp_comm": raw["dp_grad"] + raw["dp_param"]}
    return {k: v - st.parts.get(k, 0.0) for k, v in total.items() if v > st.parts.get(k, 0.0) + 1e-12}


def write_report(out_dir, plans: list, recommended, reasons: list, spec, cluster, w) -> Path:
    """Write plan.md, memory.png and timeline.png into ``out_dir``; returns the markdown path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fitting = [p for p in plans if p.memory]
    if fitting:
        plot_memory(fitting, out / "memory.png", cluster.accelerator.hbm_bytes)
    if recommended is not None and recommended.step is not None:
        plot_timeline(recommended, out / "timeline.png")
    md = out / "plan.md"
    md.write_text(markdown_report(plans, recommended, reasons, spec, cluster, w))
    return md
