"""Achieved matmul FLOP/s against the device's peak, square sizes 256 ... 16384 (the HFU curve).

    python bench/matmul_sweep.py [--sizes 256,512,...] [--dtypes float32,bfloat16] [--budget-s 60]
                                 [--out bench/results/matmul_sweep_<device>.json] [--png PATH]

For each dtype and size n, ``C = A @ B`` with A, B (n, n) is timed by ``ndtrain.tools.bench_utils.time_fn``
(warm-up, CUDA events on GPU, median of repeats); achieved FLOP/s = 2 n^3 / median seconds, and
``hfu`` = achieved / peak. Peak: on a GPU the datasheet dense peak of ``ndtrain.train.metrics`` (e.g. H100
/ H200 bf16 989 TFLOP/s); on a CPU ``bench_utils.cpu_peak_estimate`` (cores x nominal clock x FLOPs
per cycle of the widest unit, or the best matmul rate measured, whichever is larger: stated in the
JSON). Small matrices cannot fill the machine (launch / threading overhead, too few tiles per core);
large ones approach the peak: that is the curve. On a CPU the sweep stops growing n when the next
size (~8x the last one's time) would take the dtype past ``--budget-s`` seconds (a 16384 fp32
matmul alone takes over a minute on 2 cores). Writes JSON and ``docs/images/hfu_sweep_<device>.png``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ndtrain.tools import bench_utils

SIZES = (256, 512, 1024, 2048, 4096, 8192, 16384)


def peak_for(device: torch.device, dtype: str) -> dict:
    """{"peak": FLOP/s, "source": text, ...} for ``dtype`` on ``device``."""
    if device.type == "cuda":
        from ndtrain.train.metrics import UnknownPeak, gpu_peak_flops

        name = torch.cuda.get_device_name(device)
        try:
            return {"peak": gpu_peak_flops(name, dtype), "source": f"datasheet dense peak of {name}"}
        except UnknownPeak:
            return {"peak": None, "source": f"unknown GPU {name}"}
    est = bench_utils.cpu_peak_estimate(dtype)
    return dict(est, source="max(cores x nominal clock x FLOPs/cycle, best measured matmul x cores)")


def sweep(device: torch.device, dtype: str, sizes, budget_s: float, repeats: int = 3) -> list[dict]:
    """Rows {n, median_s, flops_per_s} in size order; on CPU stops once ``budget_s`` is spent."""
    rows, spent = [], 0.0
    dt = getattr(torch, dtype)
    for n in sizes:
        t0 = time.perf_counter()
        a = torch.randn(n, n, device=device).to(dt)
        b = torch.randn(n, n, device=device).to(dt)
        reps = repeats if device.type == "cuda" or n < 4096 else 1
        tm = bench_utils.time_fn(lambda a=a, b=b: a @ b, device, warmup=1, repeats=reps)
        rows.append({"n": n, "median_s": tm.median_s, "flops_per_s": 2.0 * n**3 / tm.median_s})
        if tm.cpu_median_s:  # CPU: the rate while on a core (a shared machine deschedules long calls)
            rows[-1]["flops_per_s_on_core"] = 2.0 * n**3 / tm.cpu_median_s
        print(f"{dtype} n={n}: {rows[-1]['flops_per_s'] / 1e9:,.1f} GFLOP/s", flush=True)
        del a, b
        took = time.perf_counter() - t0
        spent += took
        if device.type == "cpu" and spent + 8 * took > budget_s:  # the next size costs ~8x (n^3)
            break
    return rows


def plot(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (dtype, entry) in enumerate(result["dtypes"].items()):
        color, rows = f"C{i}", entry["rows"]
        key = "flops_per_s_on_core" if all("flops_per_s_on_core" in r for r in rows) else "flops_per_s"
        ns = [r["n"] for r in rows]
        if key != "flops_per_s":  # wall-clock rate too, faint: on a shared CPU it includes descheduled time
            ax.plot(
                ns,
                [r["flops_per_s"] / 1e9 for r in rows],
                "x:",
                color=color,
                alpha=0.5,
                label=f"{dtype} achieved (wall clock)",
            )
        ax.plot(
            ns,
            [r[key] / 1e9 for r in rows],
            "o-",
            color=color,
            label=f"{dtype} achieved" + (" (on-core: CPU time)" if key != "flops_per_s" else ""),
        )
        if entry["peak"]:
            ax.axhline(
                entry["peak"] / 1e9, color=color, ls="--", label=f"{dtype} peak {entry['peak'] / 1e9:,.0f}"
            )
            for r in rows:
                ax.annotate(
                    f"{100 * r[key] / entry['peak']:.0f}%",
                    (r["n"], r[key] / 1e9),
                    textcoords="offset points",
                    xytext=(0, 6),
                    ha="center",
                    fontsize=7,
                    color=color,
                )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("matrix size n (n x n @ n x n)")
    ax.set_ylabel("GFLOP/s")
    m = result["machine"]
    ax.set_title(
        f"matmul FLOP/s vs peak: {m['device_name']} ({m['cpu_count']} CPUs, load {m['load_avg_1_5_15'][0]})"
        if result["device"] == "cpu"
        else f"matmul FLOP/s vs peak: {m['device_name']}",
        fontsize=9,
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument(
        "--budget-s", type=float, default=60.0, help="CPU: seconds per dtype before the sweep stops"
    )
    ap.add_argument("--device", default=None, help="cuda | cpu (default: cuda when present)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--png", default=None)
    a = ap.parse_args(argv)
    dev = bench_utils.as_device(a.device)
    sizes = [int(s) for s in a.sizes.split(",")]
    result = {"device": dev.type, "dtypes": {}}
    for dtype in a.dtypes.split(","):
        peak = peak_for(dev, dtype)
        rows = sweep(dev, dtype, sizes, a.budget_s)
        for r in rows:
            r["hfu"] = r["flops_per_s"] / peak["peak"] if peak["peak"] else None
            if peak["peak"] and "flops_per_s_on_core" in r:
                r["hfu_on_core"] = r["flops_per_s_on_core"] / peak["peak"]
        result["dtypes"][dtype] = dict(peak, rows=rows)
    out = Path(a.out or ROOT / "bench" / "results" / f"matmul_sweep_{dev.type}.json")
    bench_utils.write_result(out, result, dev)
    result["machine"] = bench_utils.machine_info(dev)
    plot(result, Path(a.png or ROOT / "docs" / "images" / f"hfu_sweep_{dev.type}.png"))
    print(f"-> {out}")
    return result


if __name__ == "__main__":
    main()
