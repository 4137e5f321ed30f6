"""Pipeline timelines, planned (``planned_timeline``: F = 1, B = 2 or F = B = W = 1 when split, free
p2p) and measured (``gather_measured_timeline`` from an ``ActionTimer``), as text and PNG, with
each rank's bubble next to its textbook formula (``bubble_report``)."""
from __future__ import annotations

from pathlib import Path

from ndtrain.parallel import comm
from ndtrain.parallel.pp.schedules import bubble_formula, build_schedule
from ndtrain.parallel.pp.simulate import Event, Timeline, simulate

_B36 = "0123456789abcdefghijklmnopqrstuvwxyz"


def planned_timeline(name: str, p: int, m: int, v: int = 1) -> Timeline:
    """Simulated timeline of schedule ``name`` (unit F time per chunk; see module docstring)."""
    s = build_schedule(name, p, m, v)
    tl = simulate(s, t_f=1.0 / v, t_w=1.0 / v)  # a chunk holds 1/v of the rank's layers
    tl.meta["kind"] = "planned"
    return tl


def measured_timeline(events: list[list[Event]], name: str, m: int, v: int = 1) -> Timeline:
    """A ``Timeline`` from per-rank events with absolute timestamps (shifted to start at 0)."""
    t0 = min(e.start for evs in events for e in evs)
    shifted = [[Event(e.kind, e.mb, e.chunk, e.start - t0, e.end - t0) for e in evs] for evs in events]
    return Timeline(len(events), shifted, name, m, v, {"kind": "measured"})


def gather_measured_timeline(timer, group) -> Timeline:
    """Collective over the pp ``group``: the last step timed by ``timer``, on every rank
    (``comm.all_gather_object``, counted on pp)."""
    events = comm.all_gather_object(timer.events, group)
    return measured_timeline(events, timer.name, timer.m, timer.v)


def formula(tl: Timeline) -> float:
    return bubble_formula(tl.name, tl.p, tl.m, tl.v)


def bubble_report(tl: Timeline) -> str:
    """Lines ``rank r: idle 18.2% of the step (formula 20.0%)`` plus the mean."""
    f = formula(tl)
    rows = [f"rank {r}: idle {100 * b:5.1f}% of the step (formula {100 * f:5.1f}%)"
            for r, b in enumerate(tl.bubbles())]
    mean = sum(tl.bubbles()) / tl.p
    rows.append(f"mean:   idle {100 * mean:5.1f}%  (formula {100 * f:5.1f}%)   step span {tl.end - tl.start:.4g}"
                + (" s" if tl.meta.get("kind") == "measured" else " units"))
    return "\n".join(rows)


def _cell(e: Event) -> str:
    kind = e.kind if e.chunk % 2 == 0 else e.kind.lower()
    return kind + (_B36[e.mb] if e.mb < len(_B36) else "+")


def render_text(tl: Timeline, resolution: float | None = None, max_cells: int = 80) -> str:
    """Fixed-width picture: each 2-character cell covers ``resolution`` (default the shortest action, or
    span / max_cells) and shows the action at its midpoint ("F3") or ".." when idle."""
    span = tl.end - tl.start
    shortest = min(e.end - e.start for evs in tl.events for e in evs)
    res = resolution or max(shortest, span / max_cells)
    n = max(1, round(span / res))
    lines = [f"{tl.name} p={tl.p} m={tl.m}" + (f" v={tl.v}" if tl.v > 1 else "")
             + f" ({tl.meta.get('kind', 'timeline')}; one cell = {res:.3g}"
             + (" s)" if tl.meta.get("kind") == "measured" else " units)")]
    for r, evs in enumerate(tl.events):
        row = []
        for i in range(n):
            t = tl.start + (i + 0.5) * res
            hit = next((e for e in evs if e.start <= t < e.end), None)
            row.append(_cell(hit) if hit else "..")
        lines.append(f"rank {r} |" + "".join(row) + "|")
    lines.append(bubble_report(tl))
    return "\n".join(lines)


_COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}


def render_png(tl: Timeline, path: str | Path, title: str | None = None) -> Path:
    """Draw the timeline with matplotlib (Agg) to ``path``; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = max(6.0, min(18.0, 0.18 * sum(len(e) for e in tl.events) / max(tl.p, 1) + 4))
    fig, ax = plt.subplots(figsize=(width, 0.55 * tl.p + 1.4))
    span = tl.end - tl.start
    for r, evs in enumerate(tl.events):
        for e in evs:
            alpha = 1.0 if e.chunk % 2 == 0 else 0.55
            ax.broken_barh([(e.start - tl.start, e.end - e.start)], (r - 0.4, 0.8),
                           facecolors=_COLORS[e.kind], edgecolor="black", linewidth=0.4, alpha=alpha)
            if (e.end - e.start) > span / 90:
                ax.text((e.start + e.end) / 2 - tl.start, r, str(e.mb), ha="center", va="center",
                        fontsize=7, color="white")
    f = formula(tl)
    bub = tl.bubbles()
    ax.set_yticks(range(tl.p))
    ax.set_yticklabels([f"rank {r}\nidle {100 * b:.1f}%" for r, b in enumerate(bub)], fontsize=7)
    ax.invert_yaxis()
    unit = "seconds" if tl.meta.get("kind") == "measured" else "time units (F = 1)"
    ax.set_xlabel(unit)
    ax.set_xlim(0, span)
    head = title or (f"{tl.meta.get('kind', '')} {tl.name}: p={tl.p}, m={tl.m}"
                     + (f", v={tl.v}" if tl.v > 1 else ""))
    ax.set_title(f"{head}   mean idle {100 * sum(bub) / tl.p:.1f}% (formula {100 * f:.1f}%)", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLORS.values()]
    ax.legend(handles, ["F forward", "B backward (input grad if W shown)", "W weight grad"],
              fontsize=7, loc="upper right", bbox_to_anchor=(1.0, -0.18), ncol=3, frameon=False)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
