"""Peak memory of the fused linear + cross-entropy against eager logits + ``F.cross_entropy``.

    python bench/fused_ce_memory.py [--tokens 512] [--vocab 128256] [--dim 256]

Each variant runs forward + backward of the loss of ``h @ W^T`` (h (N, C), W (V, C), fp32) in a
fresh process and reports the rise of the process's peak memory over what it held just before the
loss (inputs allocated, kernels warmed up): on CUDA ``max_memory_allocated``, on CPU the maximum
resident set size (glibc's mmap threshold fixed at 1 MiB, so freed blocks leave the RSS). Baseline in the same command: eager (``h @ W^T`` materialised, then
``F.cross_entropy``). On a CPU the Triton kernels run in the interpreter (``TRITON_INTERPRET=1``):
the memory is representative, the time is not. Writes ``bench/results/fused_ce_memory.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _peak(device) -> int:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _child(variant: str, n: int, v: int, c: int) -> dict:
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT))
    from ndtrain.ops.linear_cross_entropy.triton import fused_linear_cross_entropy

    torch.set_num_threads(1)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, c, generator=g).to(dev).requires_grad_(True)
    w = torch.randn(v, c, generator=g).mul_(0.02).to(dev).requires_grad_(True)  # in place: no transient copy
    y = torch.randint(0, v, (n,), generator=g).to(dev)

    def loss_fn(h_, w_, y_):
        if variant == "eager":
            return F.cross_entropy(h_ @ w_.t(), y_, reduction="sum")
        return fused_linear_cross_entropy(h_, w_, y_).sum()

    loss_fn(h[:4].detach().requires_grad_(True), w[:64].detach().requires_grad_(True), y[:4] % 64).backward()
    w.grad = h.grad = None
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = _peak(dev) if dev.type == "cuda" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    loss = loss_fn(h, w, y)
    loss.backward()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return {"variant": variant, "device": dev.type, "loss": loss.item(), "seconds": time.perf_counter() - t0,
            "peak_rise_bytes": _peak(dev) - before, "grad_w_norm": w.grad.norm().item()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--child", default="")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(_child(a.child, a.tokens, a.vocab, a.dim)))
        return
    # fixed mmap threshold: freed large blocks go back to the OS, so the CPU's max RSS tracks live memory
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="1048576")
    env.setdefault("TRITON_INTERPRET", "0" if _has_cuda() else "1")
    rows = {}
    for variant in ("eager", "fused"):
        out = subprocess.run([sys.executable, __file__, "--child", variant, "--tokens", str(a.tokens), "--vocab",
                              str(a.vocab), "--dim", str(a.dim)], env=env, check=True, capture_output=True, text=True)
        rows[variant] = json.loads(out.stdout.strip().splitlines()[-1])
        print(rows[variant], flush=True)
    logits_bytes = a.tokens * a.vocab * 4
    result = {"tokens": a.tokens, "vocab": a.vocab, "dim": a.dim, "fp32_logits_bytes": logits_bytes,
              "eager": rows["eager"], "fused": rows["fused"],
              "peak_ratio_fused_over_eager": rows["fused"]["peak_rise_bytes"] / rows["eager"]["peak_rise_bytes"],
              "loss_rel_diff": abs(rows["fused"]["loss"] - rows["eager"]["loss"]) / abs(rows["eager"]["loss"])}
    out_path = ROOT / "bench" / "results" / "fused_ce_memory.json"
    out_path.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("eager", "fused")}), f"-> {out_path}")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
