"""The rehearsal's table: per role, peak tensor memory by category beside the planner's estimate
of the stage, and every collective per mesh axis (count and bytes sent)."""
from __future__ import annotations

MiB = 2**20
_MEM = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "buffers", "other")


def _mib(b: float) -> str:
    return f"{b / MiB:.3f}" if b < 10 * MiB else f"{b / MiB:.0f}"


def format_report(res: dict) -> str:
    """Plain-text table of ``run.rehearse``'s result (MiB)."""
    hw = res["hardware"]
    lines = [(f"rehearsal of {res['preset']} on {res['world']} x {hw['name']} "
              f"({_mib(hw['memory_bytes'])} MiB each): {res['layout']}"),
             "peak tensor memory at the peak moment, MiB (allocator overhead not included)"]
    if res.get("moe_routing"):
        how = ("ep rank 0's experts get S x the mean, by sequence position" if res["moe_routing"].startswith("skewed:")
               else "training.moe_routing=balanced: round-robin by sequence position")
        lines.insert(1, f"moe routing: {res['moe_routing']} (forced; {how})")
    head = ["role", "ranks"] + [c[:11] for c in _MEM] + ["total", "planner", "fits", "est busy s", "wall s", "host MiB"]
    rows = []
    for r in res["roles"]:
        m, role = r["memory_peak"], r["role"]
        plan = r["planner"].get("total_bytes")
        rows.append([role["name"], str(role["ranks_alike"])] + [_mib(m.get(c, 0)) for c in _MEM]
                    + [_mib(m["total"]), _mib(plan) if plan is not None else "-", "yes" if r["fits"] else "NO",
                       f"{r['time']['busy_s']:.4g}" if "time" in r else "-",
                       f"{r['wall_s']:.1f}", _mib(r["host_peak_bytes"])])
    lines += _table(head, rows)
    if res.get("time"):
        t = res["time"]
        lines.append(f"estimated step on {hw['name']} (roofline of the operators run, comm from the bytes counted; "
                     f"over {t['roles_rehearsed']} role(s)): {t['step_s']:.4g} s = slowest busy {t['busy_s']:.4g} s "
                     f"+ bubble {t['bubble_s']:.4g} s; MFU {100 * t['mfu']:.1f}%")
    lines.append("collectives per mesh axis (this rank, one step): count x op, MiB sent")
    crow = []
    for r in res["roles"]:
        for axis, ops in sorted(r["collectives"].items()):
            desc = ", ".join(f"{n} {op}" for op, n in sorted(ops.items()))
            crow.append([r["role"]["name"], axis, desc, f"{r['axis_bytes'].get(axis, 0.0) / 2**20:.3f}"])
    lines += _table(["role", "axis", "collectives", "MiB sent"], crow)
    return "\n".join(lines)


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    fmt = lambda row: "  ".join(str(x).ljust(w) for x, w in zip(row, widths))
    return [fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]
