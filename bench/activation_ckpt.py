"""Peak activation memory and step time per activation-checkpointing policy on deep, narrow models.

For L in {4, 16, 64} blocks (dim 64, T 256, batch 4, float32, one process, CPU) and each policy
(none, full, every:2, sqrt, selective), runs forward + backward and reports:

* ``act_peak_bytes``: ``ndtrain.mem_account.ActivationMeter`` (live activation storages, peak over
  forward + backward, including the recompute of one region and activation gradients);
* ``kept_after_forward_bytes``: live activation bytes between forward and backward (what the policy
  stores: O(L) block inputs for ``full``, O(sqrt(L)) for ``sqrt``);
* ``step_s``: median wall time of forward + backward over ``--iters`` repeats, the policies
  interleaved (noisy on a shared machine), and ``flops`` (``torch.utils.flop_counter``: matmul / attention FLOPs actually run,
  recompute included; the deterministic measure of the recompute overhead);
* ratios against ``none`` in the same run, and the growth factor of the peak from L=4 to L=64
  (O(L): 16x; O(sqrt(L)): 4x).

Usage: ``python bench/activation_ckpt.py [--iters 3] [--layers 4,16,64]``; writes
``bench/results/activation_ckpt.json``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from ndtrain.config import ModelConfig
from ndtrain.mem_account import ActivationMeter
from ndtrain.model import build_model
from ndtrain.parallel.ac_policy import example_policies
from ndtrain.parallel.activation_ckpt import apply_activation_checkpoint

POLICIES = example_policies()  # ndtrain.parallel.ac_policy: the one list


def build(n_layers: int, policy: str, batch: int = 4, seq: int = 256):
    """A model with ``policy`` applied and a forward + backward closure ``fwd_bwd(meter=None)``."""
    cfg = ModelConfig(vocab_size=64, dim=64, n_layers=n_layers, n_heads=4, ffn_hidden=172,
                      max_seq_len=seq, rope_theta=10000.0)
    model = build_model(cfg, "cpu", torch.float32, seed=0)
    apply_activation_checkpoint(model, policy)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 64, (batch, seq), generator=g)
    y = torch.randint(0, 64, (batch, seq), generator=g)

    def fwd_bwd(meter=None):
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        kept = meter.current if meter is not None else 0  # saved for backward (+ the logits)
        loss.backward()
        return loss.item(), kept

    return model, fwd_bwd


def measure(n_layers: int, iters: int) -> list[dict]:
    """All policies at one depth; timed repeats interleave the policies so noise hits all alike."""
    runs = {pol: build(n_layers, pol) for pol in POLICIES}
    rows = {}
    for pol, (model, fwd_bwd) in runs.items():
        with ActivationMeter(model.parameters()) as meter:
            loss, kept = fwd_bwd(meter)
        with FlopCounterMode(display=False) as flops:  # deterministic: recompute shows up as FLOPs
            fwd_bwd()
        rows[pol] = {"layers": n_layers, "policy": pol, "act_peak_bytes": meter.peak,
                     "kept_after_forward_bytes": kept, "flops": flops.get_total_flops(), "loss": loss,
                     "times": []}
    for _ in range(iters):
        for pol, (_, fwd_bwd) in runs.items():
            t0 = time.perf_counter()
            fwd_bwd()
            rows[pol]["times"].append(time.perf_counter() - t0)
    for r in rows.values():
        r["step_s"] = statistics.median(r.pop("times"))
    return [rows[p] for p in POLICIES]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--layers", default="4,16,64")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for n in [int(v) for v in args.layers.split(",")]:
        results = measure(n, args.iters)
        base = results[0]
        for pol, r in zip(POLICIES, results):
            r["mem_vs_none"] = r["act_peak_bytes"] / base["act_peak_bytes"]
            r["time_vs_none"] = r["step_s"] / base["step_s"]
            r["flops_vs_none"] = r["flops"] / base["flops"]
            assert r["loss"] == base["loss"], "every policy must give the same loss"
            rows.append(r)
            print(f"L={n:3d} {pol:10s} kept {r['kept_after_forward_bytes'] / 2**20:8.2f} MiB  "
                  f"act peak {r['act_peak_bytes'] / 2**20:8.2f} MiB "
                  f"({r['mem_vs_none']:.2f}x none)  step {r['step_s'] * 1e3:8.1f} ms "
                  f"({r['time_vs_none']:.2f}x none)  FLOPs {r['flops_vs_none']:.2f}x none", flush=True)
    layers = sorted({r["layers"] for r in rows})
    growth = {}
    for pol in POLICIES:
        lo = next(r for r in rows if r["policy"] == pol and r["layers"] == layers[0])
        hi = next(r for r in rows if r["policy"] == pol and r["layers"] == layers[-1])
        growth[pol] = {k: hi[k] / lo[k] for k in ("act_peak_bytes", "kept_after_forward_bytes")}
        print(f"growth L={layers[0]} -> L={layers[-1]}: {pol:10s} peak {growth[pol]['act_peak_bytes']:.2f}x "
              f"kept {growth[pol]['kept_after_forward_bytes']:.2f}x")
    out = Path(__file__).resolve().parent / "results" / "activation_ckpt.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "growth": growth, "threads": torch.get_num_threads(),
                               "torch": torch.__version__}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
