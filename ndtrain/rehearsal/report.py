"""The rehearsal's table: per role, peak tensor memory by category beside the planner's estimate
of the stage, and every collective per mesh axis (count and bytes sent).

Sizes are in GiB when the largest peak is at least 1 GiB (MiB below that, the debug presets);
a memory category that is zero on every role is left out, and so is a collective row that sends
no bytes (an axis of size 1): one line names those instead. The table stays under 120 columns."""
from __future__ import annotations

_MEM = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "buffers", "other")
_SHORT = {"parameters": "params", "gradients": "grads", "optimizer_state": "optim", "activations": "activ",
          "temporaries": "temps", "buffers": "buffers", "other": "other"}


def _unit(res: dict) -> tuple[str, float]:
    """GiB when the largest rehearsed peak is at least 1 GiB, else MiB (the debug presets)."""
    top = max([r["memory_peak"]["total"] for r in res["roles"]] + [0])
    return ("GiB", 2.0**30) if top >= 2**30 else ("MiB", 2.0**20)


def _size(b: float, scale: float) -> str:
    v = b / scale
    return f"{v:.2f}" if v < 100 else f"{v:.1f}"


def _role_label(name: str) -> str:
    """'stage 0: blocks 0-9 + embedding' -> 'stage 0' (the whole name is in the legend)."""
    return name.split(":", 1)[0]


def format_report(res: dict) -> str:
    """Plain-text table of ``run.rehearse``'s result."""
    hw = res["hardware"]
    unit, scale = _unit(res)
    lines = [(f"rehearsal of {res['preset']} on {res['world']} x {hw['name']} "
              f"({hw['memory_bytes'] / 2**30:.1f} GiB each): {res['layout']}")]
    if res.get("moe_routing"):
        how = ("ep rank 0's experts get S x the mean, by sequence position" if res["moe_routing"].startswith("skewed:")
               else "training.moe_routing=balanced: round-robin by sequence position")
        lines.append(f"moe routing: {res['moe_routing']} (forced; {how})")
    lines.append("roles:")
    lines += [f"  {r['role']['name']} (rank {r['role']['rank']}, {r['role']['ranks_alike']} ranks alike)"
              for r in res["roles"]]
    lines += [f"peak tensor memory at the peak moment, {unit} (allocator overhead not included)"]
    cats = [c for c in _MEM if any(r["memory_peak"].get(c, 0) for r in res["roles"])]
    head = ["role"] + [_SHORT[c] for c in cats] + ["total", "planner", "fits", "busy s", "wall s", f"host {unit}"]
    rows = []
    for r in res["roles"]:
        m, plan = r["memory_peak"], r["planner"].get("total_bytes")
        rows.append([_role_label(r["role"]["name"])] + [_size(m.get(c, 0), scale) for c in cats]
                    + [_size(m["total"], scale), _size(plan, scale) if plan is not None else "-",
                       "yes" if r["fits"] else "NO", f"{r['time']['busy_s']:.3g}" if "time" in r else "-",
                       f"{r['wall_s']:.1f}", _size(r["host_peak_bytes"], scale)])
    lines += _table(head, rows)
    if res.get("time"):
        t = res["time"]
        lines.append(f"estimated step on {hw['name']} (roofline of the operators run, comm from the bytes counted; "
                     f"over {t['roles_rehearsed']} role(s)):")
        lines.append(f"  {t['step_s']:.3f} s = slowest busy {t['busy_s']:.3f} s + bubble {t['bubble_s']:.3f} s; "
                     f"MFU {100 * t['mfu']:.1f}%")
    lines += _collectives(res)
    return "\n".join(lines)


def _collectives(res: dict) -> list[str]:
    """Rows (role, axis, count x op, MiB sent) for every axis that sends bytes; one line for the rest."""
    rows, silent = [], []
    for r in res["roles"]:
        label = _role_label(r["role"]["name"])
        for axis, ops in sorted(r["collectives"].items()):
            sent = r["axis_bytes"].get(axis, 0.0)
            desc = ", ".join(f"{n} {op}" for op, n in sorted(ops.items()))
            if sent:
                rows.append([label, axis, desc, f"{sent / 2**20:,.1f}"])
            else:
                silent.append(f"{label} {axis}")
    lines = ["collectives per mesh axis (this rank, one step): count x op, MiB sent"] + _table(
        ["role", "axis", "collectives", "MiB sent"], rows)
    if silent:
        lines.append("no bytes sent (axes of size 1, or only barriers): " + ", ".join(sorted(set(silent))))
    return lines


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    fmt = lambda row: "  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip()
    return [fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]
