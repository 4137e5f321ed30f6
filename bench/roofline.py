"""Roofline of this machine with every ``ndtrain.ops`` kernel on it.

    python bench/roofline.py [--device cpu|cuda] [--impl naive|triton] [--out JSON] [--png PNG]

Roofline model (Williams, Waterman & Patterson 2009): a kernel of arithmetic intensity I (FLOPs per
byte of DRAM / HBM traffic) cannot exceed min(peak FLOP/s, I x memory bandwidth). The machine's two
ceilings are measured or stated here:

* bandwidth: a STREAM-like copy (``dst.copy_(src)`` of 256 MiB on CPU, 2 GiB on GPU), counting the
  bytes read plus the bytes written, median of repeats (``ndtrain.tools.bench_utils.time_fn``); on a CPU
  the on-core rate (process CPU time) makes the roof, as it does the kernels' filled points, since a
  shared machine deschedules the process for part of the wall time (wall-clock rates are kept too);
* peak: ``bench/matmul_sweep.peak_for`` (GPU datasheet; CPU max(vector-unit estimate, best measured
  matmul)).

Each kernel's forward is one point: its FLOPs (the arithmetic of the op, counting exp / tanh /
rsqrt as one FLOP each, matmuls 2 M N K) over its compulsory bytes (every input read once, every
output written once: what a perfectly fused kernel moves), against its measured median time. On a
CPU the points are the PyTorch twins (``naive_*``: what runs there); on a GPU the Triton kernels
(``--impl triton``, the default with CUDA). A point far under the roof of its intensity is where
a kernel wastes the machine: a naive twin that materialises intermediates moves more bytes than
the compulsory count. Writes JSON and ``docs/images/roofline_<device>.png``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from matmul_sweep import peak_for

from ndtrain.tools import bench_utils


def copy_bandwidth(device: torch.device, nbytes: int) -> tuple[float, float | None]:
    """Bytes per second of a device-memory copy (read + write counted): by the wall clock, and on
    CPU also on-core (process CPU time; ``bench_utils.time_fn``), else None."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    tm = bench_utils.time_fn(lambda: dst.copy_(src), device, warmup=2, repeats=7)
    return 2.0 * nbytes / tm.median_s, (2.0 * nbytes / tm.cpu_median_s if tm.cpu_median_s else None)


def _fns(impl: str) -> dict:
    """The kernel callables of ``impl`` (naive: PyTorch twins; triton: Triton kernels)."""
    if impl == "naive":
        from ndtrain.ops.flash_attention import naive_attention as attn
        from ndtrain.ops.gelu import naive_gelu as gelu
        from ndtrain.ops.linear_cross_entropy import naive_linear_cross_entropy as ce
        from ndtrain.ops.matmul import naive_matmul as mm
        from ndtrain.ops.rmsnorm import naive_rmsnorm as rms
        from ndtrain.ops.softmax import naive_softmax as softmax
        from ndtrain.ops.swiglu import naive_swiglu as swiglu
    else:
        from ndtrain.ops.flash_attention.triton import flash_attention as attn
        from ndtrain.ops.gelu.triton import fused_gelu as gelu
        from ndtrain.ops.linear_cross_entropy.triton import fused_linear_cross_entropy as ce
        from ndtrain.ops.matmul.triton import fused_matmul as mm
        from ndtrain.ops.rmsnorm.triton import fused_rmsnorm as rms
        from ndtrain.ops.softmax.triton import fused_softmax as softmax
        from ndtrain.ops.swiglu.triton import fused_swiglu as swiglu
    return {"attn": attn, "gelu": gelu, "ce": ce, "mm": mm, "rms": rms, "softmax": softmax, "swiglu": swiglu}


def cases(device: torch.device, dtype: torch.dtype, impl: str, scale: str) -> list[dict]:
    """Per kernel: name, FLOPs, compulsory bytes and a zero-argument forward callable.

    ``scale``: "tiny" (interpreted Triton / smoke runs), "cpu", or "gpu" sizes."""
    f = _fns(impl)
    s = {"tiny": 1, "cpu": 16, "gpu": 64}[scale]
    e = torch.tensor([], dtype=dtype).element_size()
    r = lambda *shape: torch.randn(*shape, device=device).to(dtype)
    n = 2**14 * s * s // 4  # elementwise length: 4k / 1M / 16M
    rows, cols = 64 * s, 256 * s // 4 if s > 1 else 256
    x, a, b = r(n), r(n), r(n)
    xs, w = r(rows, cols), torch.ones(cols, device=device, dtype=dtype)
    m = 64 * s  # matmul: 64 / 1024 / 4096
    ma, mb, bias = r(m, m), r(m, m), r(m)
    t_doc, docs, h, g, d = (
        (32 * s if s < 64 else 2048),
        2 if s < 64 else 4,
        8 if s < 64 else 16,
        2,
        64 if s < 64 else 128,
    )
    nt = t_doc * docs
    q, k, v = r(nt, h, d), r(nt, g, d), r(nt, g, d)
    cu = torch.arange(0, nt + 1, t_doc, device=device, dtype=torch.int32)
    ce_n, ce_v, ce_c = (64, 512, 32) if s == 1 else (1024, 32768, 256) if s == 16 else (8192, 128256, 2048)
    hh, ww = r(ce_n, ce_c), r(ce_v, ce_c) * 0.02
    lab = torch.randint(0, ce_v, (ce_n,), device=device)
    causal_pairs = docs * t_doc * (t_doc + 1) / 2
    return [
        {"name": "gelu", "flops": 8.0 * n, "bytes": 2 * n * e, "fn": lambda: f["gelu"](x)},
        {"name": "swiglu", "flops": 5.0 * n, "bytes": 3 * n * e, "fn": lambda: f["swiglu"](a, b)},
        {
            "name": "softmax",
            "flops": 5.0 * rows * cols,
            "bytes": 2 * rows * cols * e,
            "fn": lambda: f["softmax"](xs),
        },
        {
            "name": "rmsnorm",
            "flops": 4.0 * rows * cols,
            "bytes": (2 * rows * cols + cols) * e,
            "fn": lambda: f["rms"](xs, w, 1e-6),
        },
        {
            "name": "matmul+bias+gelu",
            "flops": 2.0 * m**3 + 9.0 * m * m,
            "bytes": (3 * m * m + m) * e,
            "fn": lambda: f["mm"](ma, mb, bias, "gelu"),
        },
        {
            "name": "attention (causal)",
            "flops": 4.0 * h * d * causal_pairs + 5.0 * h * causal_pairs,
            "bytes": (2 * nt * h * d + 2 * nt * g * d) * e,
            "fn": lambda: f["attn"](q, k, v, cu),
        },
        {
            "name": "linear+CE",
            "flops": 2.0 * ce_n * ce_v * ce_c + 5.0 * ce_n * ce_v,
            "bytes": (ce_n * ce_c + ce_v * ce_c) * e + ce_n * 12,
            "fn": lambda: f["ce"](hh, ww, lab),
        },
    ]


def measure(device, dtype, impl, scale, repeats) -> list[dict]:
    out = []
    for c in cases(device, dtype, impl, scale):
        with torch.no_grad():
            tm = bench_utils.time_fn(c["fn"], device, warmup=1, repeats=repeats)
        row = {k: c[k] for k in ("name", "flops", "bytes")}
        row.update(
            intensity=c["flops"] / c["bytes"], median_s=tm.median_s, flops_per_s=c["flops"] / tm.median_s
        )
        if tm.cpu_median_s:  # CPU: the rate while on a core (bench_utils: a shared machine deschedules calls)
            row["flops_per_s_on_core"] = c["flops"] / tm.cpu_median_s
        print(
            f"{row['name']}: I={row['intensity']:.2f} FLOP/B, {row['flops_per_s'] / 1e9:,.2f} GFLOP/s",
            flush=True,
        )
        out.append(row)
    return out


def plot(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peak, bw = result["peak_flops_per_s"], result["bandwidth_bytes_per_s"]
    fig, ax = plt.subplots(figsize=(7.5, 5))
    xs = [2.0**i for i in range(-4, 13)]
    ax.plot(
        xs,
        [min(peak, x * bw) / 1e9 for x in xs],
        "k-",
        lw=1.5,
        label=f"roof: {bw / 1e9:,.1f} GB/s, {peak / 1e9:,.0f} GFLOP/s",
    )
    for i, k in enumerate(result["kernels"]):
        y = k.get("flops_per_s_on_core", k["flops_per_s"]) / 1e9  # filled: on-core rate (CPU), else wall
        ax.plot(k["intensity"], y, "o", color=f"C{i % 10}", label=k["name"])
        if "flops_per_s_on_core" in k:  # hollow: wall clock, which includes time descheduled
            ax.plot(k["intensity"], k["flops_per_s"] / 1e9, "o", mfc="none", color=f"C{i % 10}")
        ax.annotate(
            k["name"],
            (k["intensity"], y),
            textcoords="offset points",
            xytext=(4, -10),
            fontsize=7,
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOPs / compulsory byte)")
    ax.set_ylabel(
        "GFLOP/s (CPU: filled on-core, hollow wall clock)" if result["device"] == "cpu" else "GFLOP/s"
    )
    m = result["machine"]
    ax.set_title(
        f"roofline: {m['device_name']} ({result['dtype']}, {result['impl']} kernels, "
        f"load {m['load_avg_1_5_15'][0]})",
        fontsize=9,
    )
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--impl", default=None, help="naive | triton (default: triton on CUDA, else naive)")
    ap.add_argument("--scale", default=None, help="tiny | cpu | gpu (default: the device's)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--png", default=None)
    a = ap.parse_args(argv)
    dev = bench_utils.as_device(a.device)
    impl = a.impl or ("triton" if dev.type == "cuda" else "naive")
    scale = a.scale or ("gpu" if dev.type == "cuda" else "cpu")
    dtype = "bfloat16" if dev.type == "cuda" else "float32"
    peak = peak_for(dev, dtype)
    bw_wall, bw_core = copy_bandwidth(
        dev, 2**31 if dev.type == "cuda" else 2**28 if scale != "tiny" else 2**22
    )
    bw = bw_core or bw_wall  # the roof: on CPU the on-core rate, like the kernels' filled points
    print(
        f"copy bandwidth {bw / 1e9:,.1f} GB/s; peak {dtype} {(peak['peak'] or 0) / 1e9:,.0f} GFLOP/s",
        flush=True,
    )
    result = {
        "device": dev.type,
        "impl": impl,
        "dtype": dtype,
        "scale": scale,
        "peak_flops_per_s": peak["peak"],
        "peak_source": peak["source"],
        "bandwidth_bytes_per_s": bw,
        "bandwidth_wall_bytes_per_s": bw_wall,
        "ridge_intensity": (peak["peak"] or 0) / bw,
        "kernels": measure(dev, getattr(torch, dtype), impl, scale, a.repeats),
    }
    out = Path(a.out or ROOT / "bench" / "results" / f"roofline_{dev.type}.json")
    bench_utils.write_result(out, result, dev)
    result["machine"] = bench_utils.machine_info(dev)
    plot(result, Path(a.png or ROOT / "docs" / "images" / f"roofline_{dev.type}.png"))
    print(f"-> {out}")
    return result


if __name__ == "__main__":
    main()
