"""Step time of ndtrain's eager trainer from component times measured on the same machine (CPU).

The GPU model (``timing.py``) multiplies datasheet peaks by global efficiencies. On a CPU the
eager implementation sets the time, so this model adds up the step's components, each timed in
isolation at the run's shapes, with the run's threads per rank and number of concurrent ranks
(``measure_eager.measure_eager_rates``), and never fitted to a training run:

    step = m * (t_gemm + L * (t_attn + 2 t_norm + t_rope + t_swiglu + 2 t_residual)
                + t_norm + t_loss + recompute) + t_param + t_comm

* ``t_gemm``: the microbatch's matmuls, forward 2 s N_mm FLOPs and backward 4 s N_mm (N_mm the
  projection and head weights, s tokens), at the FLOP/s measured on exactly these (m, k, n)
  shapes (``gemm_flops_per_s``; its ratio to the square-matmul peak of ``measure_matmul_flops`` is
  the small-matmul efficiency of eager training).
* the other components, forward + backward each (``<name>_s``): attention core (CPU flash SDPA),
  RMSNorm, RoPE of q and k, SiLU(g) * u, residual add, cross-entropy; ``full`` checkpointing adds
  one more forward of every block (``<name>_fwd_s`` and a third of the block's matmul FLOPs).
* ``t_param``: per-parameter passes, timed per parameter: AdamW over the rank's optimizer state,
  the fp64 global-norm clip over its gradients, gradient accumulation over the extra microbatches
  (``add_``), data-parallel flatten / copy-back (DDP buckets, ZeRO packs and unpacks).
* ``t_comm``: gloo collectives with the alpha-beta ring model on the measured loopback alpha /
  beta, *not* overlapped: on a CPU the collectives' copies and reductions run on the same cores.

Not modelled: Python / autograd-engine overhead between ops (a few % of these steps), the
optimizer's state-dict bookkeeping, and other jobs on the machine (measure the rates right before
the run they predict).
"""
from __future__ import annotations

import math

from ndtrain.planner.eager import padded_shard_numel, param_shapes

BLOCK_COMPONENTS = {"attn": 1, "norm": 2, "rope": 1, "swiglu": 1, "residual": 2}


def linear_shapes(spec) -> list[tuple[int, int, int]]:
    """(k in, n out, count) of the model's matmul weights: per-layer projections and the head."""
    h, q, k, f, L = spec.dim, spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim, \
        spec.ffn_hidden, spec.n_layers
    return [(h, q, L), (h, k, 2 * L), (q, h, L), (h, f, 2 * L), (f, h, L), (h, spec.vocab_size, 1)]


def eager_gemm_flops(spec, tokens: int, policy: str = "none") -> float:
    """Matmul FLOPs of one microbatch of ``tokens`` tokens: 6 s N_mm, + 2 s N_layers under ``full``."""
    n_mm = sum(a * b * c for a, b, c in linear_shapes(spec))
    out = 6.0 * tokens * n_mm
    if policy == "full":
        out += 2.0 * tokens * (n_mm - spec.dim * spec.vocab_size)
    return out


def eager_param_counts(spec, zero_stage: int, n_shards: int, n_micro: int, world: int) -> dict:
    """Elements each per-parameter pass touches on one rank (ZeRO: the padded shard S)."""
    shapes = [sh for _, sh in param_shapes(spec)]
    psi = sum(math.prod(sh) for sh in shapes)
    n = max(1, n_shards) if zero_stage else 1
    S = padded_shard_numel(shapes, n)
    if zero_stage == 0:
        return {"optim": psi, "clip": psi, "accum": psi * (n_micro - 1), "copy": psi if world > 1 else 0}
    acc = psi if zero_stage == 1 else S
    copies = {1: 2 * psi, 2: (n_micro + 1) * psi, 3: 3 * n_micro * psi}[zero_stage]
    return {"optim": S, "clip": psi / n, "accum": acc * (n_micro - 1), "copy": copies}


def eager_comm_seconds(spec, zero_stage: int, dp_shard: int, dp_replicate: int, n_micro: int,
                       alpha_s: float, beta_bytes_per_s: float, dtype: str = "float32",
                       bucket_size_bytes: int = 25 * 2**20) -> float:
    """Gloo seconds of one step's data-parallel collectives per rank (ring alpha-beta: all-reduce
    2(n-1)/n V / beta + 2(n-1) alpha, all-gather / reduce-scatter (n-1)/n V / beta + (n-1) alpha;
    Thakur et al. 2005), padded as ``ndtrain.parallel.zero.flat_shard`` pads, not overlapped."""
    e = 8 if dtype == "float64" else 4
    shapes = [sh for _, sh in param_shapes(spec)]
    psi = sum(math.prod(sh) for sh in shapes)
    world = dp_shard * dp_replicate
    if world == 1:
        return 0.0
    n_buckets = max(1, -(-e * psi // bucket_size_bytes))

    def ring(n, nbytes, alphas):
        return nbytes / beta_bytes_per_s + alphas * (n - 1) * alpha_s

    if zero_stage == 0:
        return ring(world, 2 * (world - 1) / world * e * psi, 2 * n_buckets)
    n = dp_shard
    S = padded_shard_numel(shapes, n)
    one = (n - 1) * S * e  # bytes per rank of one all-gather or reduce-scatter of the padded model
    units = spec.n_layers + 2  # ZeRO-3 units: embedding, blocks, head
    calls = {1: (2, 2 * n_buckets), 2: (n_micro + 1, (n_micro + 1) * n_buckets),
             3: (3 * n_micro, 3 * n_micro * units)}[zero_stage]
    t = ring(n, calls[0] * one, calls[1])
    if dp_replicate > 1:  # HSDP: all-reduce of the shards across replicas, once per step
        r = dp_replicate
        t += ring(r, 2 * (r - 1) / r * S * e, 2 * (n_buckets if zero_stage < 3 else units))
    return t


def estimate_eager_step_time(spec, microbatch: int, seq_len: int, n_micro: int, rates: dict,
                             zero_stage: int = 0, dp_shard: int = 1, dp_replicate: int = 1,
                             dtype: str = "float32", policy: str = "none", alpha_s: float = 0.0,
                             beta_bytes_per_s: float = float("inf"),
                             bucket_size_bytes: int = 25 * 2**20) -> dict:
    """Seconds of one optimizer step on one rank and its parts (see the module docstring).

    ``rates``: ``measure_eager.measure_eager_rates`` for this layout's threads per rank and concurrent
    ranks. Returns {"step_time_s", "parts"}. Raises KeyError for a missing rate, ValueError for a
    checkpointing policy other than none / full.
    """
    if policy not in ("none", "full"):
        raise ValueError(f"eager step-time model covers ac none / full, not {policy!r}")
    L = spec.n_layers
    tokens = microbatch * seq_len
    block = sum(c * rates[f"{k}_s"] for k, c in BLOCK_COMPONENTS.items())
    block_fwd = sum(c * rates[f"{k}_fwd_s"] for k, c in BLOCK_COMPONENTS.items())
    world = dp_shard * dp_replicate
    counts = eager_param_counts(spec, zero_stage, dp_shard, n_micro, world)
    parts = {
        "gemm": n_micro * eager_gemm_flops(spec, tokens, policy) / rates["gemm_flops_per_s"],
        "blocks": n_micro * L * block,
        "head": n_micro * (rates["norm_s"] + rates["loss_s"]),
        "recompute": n_micro * L * block_fwd if policy == "full" else 0.0,
        "param_passes": sum(counts[k] * rates[f"{k}_s_per_param"] for k in counts),
        "comm": eager_comm_seconds(spec, zero_stage, dp_shard, dp_replicate, n_micro, alpha_s,
                                   beta_bytes_per_s, dtype, bucket_size_bytes),
    }
    return {"step_time_s": sum(parts.values()), "parts": parts}
