"""Pipeline bubbles, in-flight microbatches, stage balancing, and the cost of checkpointing.

* Bubble (GPipe, Huang 2019; 1F1B / PipeDream-Flush, Narayanan 2021): with p stages and m
  microbatches a step takes (m + p - 1) microbatch slots of which m are useful, so the MFU ceiling
  is m / (m + p - 1) and the idle share (p - 1) / (m + p - 1). Interleaved 1F1B with v model chunks
  per rank divides the bubble by v: idle share (p - 1) / (v*m + p - 1) (Narayanan et al. 2021,
  section 2.2.2). ZB-H1 (Qi et al. 2023) splits backward into input and weight gradients and
  shrinks the 1F1B bubble from (p-1)(F+B+W) to (p-1)(F+B-W), about a third when F = B = W.
* In-flight activations: GPipe keeps all m; 1F1B keeps at most p - s on stage s (the first stage
  holds p); interleaved keeps p * (1 + (p-1)/(p*v)) microbatches' worth of the first stage's layers
  (Korthikanti et al. 2022, section 4.2.3, from Megatron's warm-up count 2(p-1) + (v-1)p + 1 chunks).
* Checkpointing (the lecture's model, Chen et al. 2016): store C evenly spaced checkpoints in an
  N-layer chain and, for each layer's backward, recompute forward from the nearest checkpoint:
  O(N^2 / C) compute and O(C) memory; C = sqrt(N) gives O(N sqrt N) compute, O(sqrt N) memory.
"""
from __future__ import annotations

import math


def pipeline_mfu_ceiling(p: int, m: int) -> float:
    """Best MFU a p-stage GPipe / 1F1B pipeline reaches with m microbatches: m / (m + p - 1)."""
    if p < 1 or m < 1:
        raise ValueError(f"p ({p}) and m ({m}) must be >= 1")
    return m / (m + p - 1)


def bubble_fraction(p: int, m: int, schedule: str = "1f1b", v: int = 1) -> float:
    """Idle share of a step (0 when p == 1); see module docstring for each schedule."""
    if p <= 1:
        return 0.0
    slots = bubble_slots(p, schedule, v)
    return slots / (m + slots)


def bubble_slots(p: int, schedule: str = "1f1b", v: int = 1) -> float:
    """The bubble in units of one microbatch's fwd + bwd on one stage."""
    if p <= 1:
        return 0.0
    if schedule == "interleaved":
        return (p - 1) / max(v, 1)
    if schedule == "zero_bubble":
        return (p - 1) / 3.0
    if schedule in ("gpipe", "1f1b"):
        return float(p - 1)
    raise ValueError(f"unknown schedule {schedule!r}")


def inflight_microbatches(p: int, m: int, schedule: str = "1f1b", v: int = 1, stage: int = 0) -> float:
    """Microbatches whose activations stage ``stage`` holds at its peak, in units of that stage's
    layers (interleaved: chunk counts divided by v)."""
    if p <= 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved" and v > 1:
        chunks = min(m * v, 2 * (p - stage - 1) + (v - 1) * p + 1)
        return chunks / v
    return float(min(m, p - stage))


def partition_layers(n_layers: int, p: int, head_cost: float = 0.0, embed_cost: float = 0.0) -> list[int]:
    """Layers per stage balancing compute (Llama 3 / issue 5: first and last stages may take fewer
    blocks because they also run the embedding and the output head). ``head_cost`` and
    ``embed_cost`` are in units of one block's time. Returns a list of p counts summing to L."""
    if p < 1 or p > n_layers:
        raise ValueError(f"cannot split {n_layers} layers into {p} stages")
    extra = [0.0] * p
    extra[0] += embed_cost
    extra[-1] += head_cost
    cap = math.ceil(n_layers / p)
    while sum(max(0, math.floor(cap - e + 1e-9)) for e in extra) < n_layers:
        cap += 1
    counts = [max(0, math.floor(cap - e + 1e-9)) for e in extra]
    excess = sum(counts) - n_layers
    order = sorted(range(p), key=lambda i: (-(counts[i] + extra[i]), i))
    i = 0
    while excess > 0:  # take layers from the most loaded stages first
        s = order[i % p]
        if counts[s] > 1:
            counts[s] -= 1
            excess -= 1
        i += 1
        if i % p == 0:
            order = sorted(range(p), key=lambda j: (-(counts[j] + extra[j]), j))
    return counts


def estimate_pipeline_time(t_fwd: float, t_bwd: float, p: int, m: int, schedule: str = "1f1b",
                           v: int = 1) -> dict:
    """Seconds for m microbatches through p stages, given the bottleneck stage's fwd and bwd time
    per microbatch (s). Returns {"busy", "bubble", "total"} in seconds."""
    busy = m * (t_fwd + t_bwd)
    if schedule == "zero_bubble" and p > 1:  # (p-1)(F + B - W), W = half of the backward
        bubble = (p - 1) * t_fwd
    else:
        bubble = bubble_slots(p, schedule, v) * (t_fwd + t_bwd)
    return {"busy": busy, "bubble": bubble, "total": busy + bubble}


def checkpoint_cost(n_layers: int, n_checkpoints: int) -> dict:
    """The lecture's recompute model for an N-layer chain with C stored checkpoints.

    Forward evaluates N layers; the backward of a layer at depth j inside a segment recomputes the
    j layers from the segment's checkpoint. Returns {"compute": layer evaluations (forward +
    recompute), "memory": layers' activations held at once (checkpoints + one working layer)}.
    C = N stores everything (O(N), O(N)); C = 1 is full recompute (O(N^2), O(1)).
    """
    if not 1 <= n_checkpoints <= n_layers:
        raise ValueError(f"n_checkpoints ({n_checkpoints}) must be in [1, {n_layers}]")
    base, rem = divmod(n_layers, n_checkpoints)
    segs = [base + 1] * rem + [base] * (n_checkpoints - rem)
    if n_checkpoints == n_layers:
        recompute = 0
    else:
        recompute = sum(s * (s - 1) // 2 for s in segs)  # layers re-run to reach each depth
    return {"compute": n_layers + recompute, "memory": n_checkpoints + 1}
