"""Each model kernel against what PyTorch runs without it: forward + backward time and peak memory.

    python bench/kernel_speed.py [--size gpu|tiny] [--out bench/results/kernel_speed_<device>.json]

Pairs (fast = ``ndtrain.ops`` Triton kernel, baseline = PyTorch):

* FlashAttention-2 ``flash_attention_bhtd`` vs ``F.scaled_dot_product_attention(is_causal=True)``
  (on a GPU torch picks its own flash / memory-efficient backend: the bar to beat), GQA;
* ``fused_rmsnorm`` vs the eager twin ``naive_rmsnorm`` (the model's eager arithmetic);
* ``fused_swiglu`` vs eager ``F.silu(a) * b``;
* ``fused_linear_cross_entropy`` vs eager ``F.cross_entropy(h @ W^T)`` (full fp32 logits).

Each side runs forward + backward on the same inputs; time = median over repeats with warm-up and
CUDA events (``ndtrain.tools.bench_utils.time_fn``); memory = rise of peak memory over the inputs during
one forward + backward (``bench_utils.peak_bytes``: CUDA allocator; on CPU live storages). The
outputs of both sides are compared (relative RMS) so a fast wrong kernel cannot pass unnoticed.
``--size gpu`` (default with CUDA): B 4, T 4096, H 32 / G 8, D 128, bf16; RMSNorm / SwiGLU rows
16384 x 4096 / 14336; CE 8192 tokens, C 4096, V 128256. ``--size tiny``: shapes that finish in
seconds in Triton's CPU interpreter (``TRITON_INTERPRET=1``, set here on a CPU): a smoke test of
the script, its times meaningless.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ndtrain.tools import bench_utils

SIZES = {
    "gpu": {
        "b": 4,
        "t": 4096,
        "h": 32,
        "g": 8,
        "d": 128,
        "rows": 16384,
        "dim": 4096,
        "ffn": 14336,
        "n": 8192,
        "v": 128256,
        "dtype": "bfloat16",
    },
    "tiny": {
        "b": 1,
        "t": 64,
        "h": 4,
        "g": 2,
        "d": 16,
        "rows": 64,
        "dim": 64,
        "ffn": 96,
        "n": 32,
        "v": 512,
        "dtype": "float32",
    },
}


def _sdpa(q, k, v):
    rep = q.shape[1] // k.shape[1]  # GQA: each kv head serves `rep` query heads
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def pairs(s: dict, dev: torch.device) -> list[dict]:
    """[{name, shapes, inputs (requires grad where differentiable), fast, base}] for size ``s``."""
    from ndtrain.ops.flash_attention.triton import flash_attention_bhtd
    from ndtrain.ops.linear_cross_entropy.triton import fused_linear_cross_entropy
    from ndtrain.ops.rmsnorm import naive_rmsnorm
    from ndtrain.ops.rmsnorm.triton import fused_rmsnorm
    from ndtrain.ops.swiglu.triton import fused_swiglu

    dt = getattr(torch, s["dtype"])
    g = torch.Generator(device="cpu").manual_seed(0)
    r = lambda *shape, scale=1.0: (torch.randn(*shape, generator=g) * scale).to(dev, dt).requires_grad_(True)
    b, t, h, kv, d = s["b"], s["t"], s["h"], s["g"], s["d"]
    labels = torch.randint(0, s["v"], (s["n"],), generator=g).to(dev)
    ce_eager = lambda x, w: F.cross_entropy((x @ w.t()).float(), labels, reduction="sum")
    ce_fused = lambda x, w: fused_linear_cross_entropy(x, w, labels).sum()
    return [
        {
            "name": "attention: flash_attention vs SDPA",
            "shapes": f"B{b} T{t} H{h} G{kv} D{d}",
            "inputs": [r(b, h, t, d), r(b, kv, t, d), r(b, kv, t, d)],
            "fast": flash_attention_bhtd,
            "base": _sdpa,
        },
        {
            "name": "rmsnorm: fused vs eager",
            "shapes": f"{s['rows']} x {s['dim']}",
            "inputs": [r(s["rows"], s["dim"]), r(s["dim"])],
            "fast": lambda x, w: fused_rmsnorm(x, w, 1e-6),
            "base": lambda x, w: naive_rmsnorm(x, w, 1e-6),
        },
        {
            "name": "swiglu: fused vs eager",
            "shapes": f"{s['rows']} x {s['ffn']}",
            "inputs": [r(s["rows"], s["ffn"]), r(s["rows"], s["ffn"])],
            "fast": fused_swiglu,
            "base": lambda a, c: F.silu(a) * c,
        },
        {
            "name": "linear+cross-entropy: fused vs eager",
            "shapes": f"N{s['n']} C{s['dim']} V{s['v']}",
            "inputs": [r(s["n"], s["dim"]), r(s["v"], s["dim"], scale=0.02)],
            "fast": ce_fused,
            "base": ce_eager,
        },
    ]


def _fwd_bwd(fn, inputs):
    def run():
        for x in inputs:
            x.grad = None
        out = fn(*inputs)
        out.backward(torch.ones_like(out))
        return out

    return run


def compare(p: dict, dev: torch.device, repeats: int) -> dict:
    """Time, peak memory and output agreement of ``p``'s fast and base sides."""
    row = {"name": p["name"], "shapes": p["shapes"]}
    outs = {}
    for side in ("base", "fast"):
        run = _fwd_bwd(p[side], p["inputs"])
        outs[side] = run().detach().float()
        tm = bench_utils.time_fn(run, dev, warmup=1, repeats=repeats)
        for x in p["inputs"]:
            x.grad = None
        row[side] = {
            "median_s": tm.median_s,
            "min_s": tm.min_s,
            "peak_bytes": bench_utils.peak_bytes(run, dev),
        }
    diff = (outs["fast"] - outs["base"]).pow(2).mean().sqrt() / outs["base"].pow(2).mean().sqrt().clamp_min(
        1e-30
    )
    row["output_rel_rms"] = diff.item()
    row["speedup"] = row["base"]["median_s"] / row["fast"]["median_s"]
    row["memory_ratio_fast_over_base"] = row["fast"]["peak_bytes"] / max(row["base"]["peak_bytes"], 1)
    print(
        f"{row['name']} [{row['shapes']}]: speedup {row['speedup']:.2f}x, memory "
        f"{row['memory_ratio_fast_over_base']:.2f}x, rel rms {row['output_rel_rms']:.1e}",
        flush=True,
    )
    return row


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default=None, help="gpu | tiny (default: gpu with CUDA, else tiny)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    dev = bench_utils.as_device(None)
    size = a.size or ("gpu" if dev.type == "cuda" else "tiny")
    rows = [compare(p, dev, a.repeats) for p in pairs(SIZES[size], dev)]
    result = {
        "size": size,
        "sizes": SIZES[size],
        "pairs": rows,
        "note": "interpreted Triton on CPU: times meaningless" if dev.type == "cpu" else "",
    }
    out = Path(a.out or ROOT / "bench" / "results" / f"kernel_speed_{dev.type}.json")
    bench_utils.write_result(out, result, dev)
    print(f"-> {out}")
    return result


if __name__ == "__main__":
    main()
