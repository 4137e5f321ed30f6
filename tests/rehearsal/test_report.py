"""The rehearsal's text table: GiB at real scale, no empty columns or zero-byte rows, narrow."""
from ndtrain.rehearsal.report import format_report

GiB = 2**30


def _role(i: int, name: str, acts: float, axes: dict) -> dict:
    return {"role": {"name": name, "rank": i * 512, "ranks_alike": 512},
            "memory_peak": {"parameters": 3.5 * GiB, "gradients": 0, "optimizer_state": 21 * GiB,
                            "activations": acts, "temporaries": 0.25 * GiB, "buffers": 0, "other": 0,
                            "total": 24.75 * GiB + acts},
            "planner": {"total_bytes": 25 * GiB + acts}, "fits": True, "time": {"busy_s": 12.3456789},
            "wall_s": 321.04, "host_peak_bytes": 6.2 * GiB,
            "collectives": {a: {"all_reduce": 2} for a in axes}, "axis_bytes": axes}


def _res() -> dict:
    return {"preset": "deepseek_v3", "world": 2048, "layout": "PP16 EP64 z1",
            "hardware": {"name": "H800", "memory_bytes": 80 * GiB}, "moe_routing": "balanced",
            "time": {"roles_rehearsed": 2, "step_s": 20.123456, "busy_s": 12.3456789, "bubble_s": 7.77777,
                     "mfu": 0.3812},
            "roles": [_role(0, "stage 0: blocks 0-3 + embedding", 30 * GiB, {"pp": 3 * 2**20, "tp": 0.0}),
                      _role(1, "stage 15: blocks 58-60 + head + MTP", 10 * GiB, {"pp": 2**20, "ep": 7 * 2**30})]}


def test_report_is_narrow_in_gib_and_leaves_out_what_is_empty():
    text = format_report(_res())
    lines = text.splitlines()
    assert max(len(l) for l in lines) <= 120, max(lines, key=len)
    head = next(l for l in lines if l.startswith("role") and "total" in l).split()
    assert head[:5] == ["role", "params", "optim", "activ", "temps"]  # gradients, buffers, other are zero
    row0 = next(l for l in lines if l.startswith("stage 0 ")).split()
    assert row0[:3] == ["stage", "0", "3.50"] and row0[4] == "30.00" and row0[6] == "54.75"  # GiB
    assert "12.3" in row0 and "12.3456789" not in text  # busy seconds, 3 significant digits
    assert "  stage 15: blocks 58-60 + head + MTP (rank 512, 512 ranks alike)" in lines  # the legend
    coll = lines[lines.index(next(l for l in lines if l.startswith("collectives"))):]
    assert not any(l.split()[:3] == ["stage", "0", "tp"] for l in coll)  # a zero-byte row is left out
    assert coll[-1] == "no bytes sent (axes of size 1, or only barriers): stage 0 tp"
    assert any(l.split()[:3] == ["stage", "15", "ep"] and l.split()[-1] == "7,168.0" for l in coll)


def test_report_uses_mib_for_tiny_models():
    res = _res()
    for r in res["roles"]:  # a debug-sized rank: 1/1024 of the figures above
        r["memory_peak"] = {k: v / 1024 for k, v in r["memory_peak"].items()}
    text = format_report(res)
    assert "MiB (allocator overhead" in text
    row0 = next(l for l in text.splitlines() if l.startswith("stage 0 ")).split()
    assert row0[2] == "3.50" and row0[4] == "30.00"  # MiB, not 0.00 GiB
