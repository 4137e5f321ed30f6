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
* DualPipeV (DeepSeek-V3 technical report 2024, section 3.2.1, and its "cut-in-half" V variant in
  the DualPipe repository): the model is cut into 2p chunks, rank r holds chunks r and 2p-1-r (so
  rank 0 holds the embedding and the head), i.e. 2x one chunk's parameters; each rank keeps PP + 1
  chunk-activations in flight with PP = 2p chunks, i.e. (2p + 1) / 2 microbatches of its layers.
  Bubble (PP/2 - 1)(F&B + B - 3W) per chunk, with F&B = F + B (overlapped forward and backward of
  two microbatches take the time of both, the all-to-all hidden) and B = W = half a chunk backward.
* Stage split: ``split_stages`` cuts the blocks with the trainer's own rule
  (``ndtrain.parallel.pp.rules.split_layers``, costs as ``parallel/pp/stage.layer_costs``), so every
  virtual stage holds >= 1 block; only Llama 3's layout (pp * v = L + 1 or L + 2, first / last chunk
  holding only the embedding / head) is modelled beyond it.
* Checkpointing (the lecture's model, Chen et al. 2016): store C evenly spaced checkpoints in an
  N-layer chain and, for each layer's backward, recompute forward from the nearest checkpoint:
  O(N^2 / C) compute and O(C) memory; C = sqrt(N) gives O(N sqrt N) compute, O(sqrt N) memory.
"""
from __future__ import annotations

import math
from functools import lru_cache

from ndtrain.parallel.pp.rules import split_layers
from ndtrain.parallel.pp.schedules import interleaved_groups


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
    if schedule == "dualpipev":  # (p - 1)(F + B + B/2 - 3B/2) per chunk = (p - 1) F / 2 per rank
        return (p - 1) / 6.0  # in units of F + B = 3F (B = 2F)
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
    if schedule == "dualpipev":  # PP + 1 chunk-activations, PP = 2p chunks, 2 chunks per rank
        return min(2 * m, 2 * p + 1) / 2
    if schedule == "zero_bubble":  # ZB-H1: rank s defers W by s microbatches, so p - s + s = p graphs
        return float(min(m, p))
    return float(min(m, p - stage))


def grad_share_at_peak(p: int, m: int, schedule: str = "1f1b", v: int = 1, stage: int = 0) -> float:
    """Share of stage ``stage``'s gradients that exist at its activation peak (the end of its
    steady state): 0 when no backward ran before it (as many microbatches as in flight), else 1;
    interleaved (``schedules.interleaved``): backwards run chunk v-1 .. 0 per microbatch group, so
    the k backwards before the steady state's last forward have reached ceil(k / g) of the v chunks
    (g the first group's size), each chunk's gradients appearing with its first backward."""
    if schedule == "interleaved" and v > 1 and p > 1:
        groups = interleaved_groups(p, m)
        warm = min(m * v, 2 * (p - stage - 1) + (v - 1) * max(groups))  # the schedule's warm-up
        done = m * v - warm - 1  # backwards before the steady state's last forward (its F precedes its B)
        return 0.0 if done <= 0 else min(v, -(-done // groups[0])) / v
    return 0.0 if m <= inflight_microbatches(p, m, schedule, v, stage) else 1.0


def partition_layers(n_layers: int, p: int, head_cost: float = 0.0, embed_cost: float = 0.0) -> list[int]:
    """Layers per stage balancing compute (Llama 3: first and last stages may take fewer
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
    elif schedule == "dualpipev" and p > 1:  # (p-1)(F&B + B - 3W) per chunk, F&B = F + 2B
        bubble = (p - 1) * t_fwd / 2
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


def rank_chunks(p: int, v: int = 1, schedule: str = "1f1b") -> list[list[int]]:
    """Virtual-stage ids each pp rank holds: interleaved chunk c of rank r is ``c * p + r``
    (Megatron, as ``parallel/pp/stage.py`` places them); DualPipeV rank r holds r and 2p-1-r."""
    if schedule == "dualpipev":
        return [[r, 2 * p - 1 - r] for r in range(p)]
    return [[c * p + r for c in range(v)] for r in range(p)]


def n_virtual_stages(p: int, v: int = 1, schedule: str = "1f1b") -> int:
    return 2 * p if schedule == "dualpipev" else p * v


def split_stages(spec, p: int, v: int = 1, schedule: str = "1f1b", seq_len: int = 4096) -> tuple:
    """Layer ids of each virtual stage (a tuple of tuples). Blocks cost their forward FLOPs per token
    (2 x the block's active parameters -- top-k routed experts, not all -- + 4 T C), the embedding
    and the head 2 V C each (the head's stage plus, per MTP depth, 2 x its active parameters,
    4 T C and another 2 V C), cut by the trainer's ``split_layers`` (every stage >= 1 block). With pp * v = L + 1 or
    L + 2 the first / last stages hold no block (Llama 3, 2024, section 3.3.2). Raises ValueError
    when the layers cannot fill the stages."""
    return _split_stages(spec, p, n_virtual_stages(p, v, schedule), seq_len)


@lru_cache(maxsize=1024)
def _split_stages(spec, p: int, n_stages: int, seq_len: int) -> tuple:
    n = spec.n_layers
    if n_stages <= 1:
        return (tuple(range(n)),)
    spare = n_stages - n
    if spare > 2:
        raise ValueError(f"cannot split {n} layers into {n_stages} pipeline stages")
    table = 2.0 * spec.vocab_size * spec.dim
    costs = [2.0 * spec.layer_params(_is_moe_layer(spec, i), True) + 4.0 * seq_len * spec.dim for i in range(n)]
    if spec.mixers:  # hybrid: each layer's own mixer parameters and sequence term, as the trainer counts
        costs = [2.0 * (spec.layer_params(_is_moe_layer(spec, i), True) + extra) + seq
                 for i, (extra, seq) in enumerate(_mixer_costs(spec, seq_len))]
    head = table + (2.0 * spec.mtp_params(active=True) + spec.mtp_depth * (4.0 * seq_len * spec.dim + table))
    if spare <= 0:
        return tuple(tuple(r) for r in split_layers(costs, n_stages, table, head))
    inner = [tuple(r) for r in split_layers(costs, n_stages - spare)]
    return tuple([()] + inner + [()] * (spare - 1))  # the embedding's chunk empty first, then the head's


def _mixer_costs(spec, seq_len: int) -> list[tuple[int, float]]:
    """Per layer: the mixer's parameters minus softmax attention's, and its forward sequence FLOPs
    per token (``mixer_spec.stage_seq_costs``)."""
    from ndtrain.mixer_spec import layer_mixers, mixer_params, stage_seq_costs

    m, attn = spec.mixers, spec.attn_params - spec.dim
    kinds = layer_mixers(m.layer_pattern, spec.n_layers)
    return [(mixer_params(m, k, attn) - attn, s) for k, s in zip(kinds, stage_seq_costs(m, seq_len))]


def _is_moe_layer(spec, i: int) -> bool:
    return spec.is_moe and i >= spec.first_dense_layers and (i - spec.first_dense_layers) % spec.moe_layer_freq == 0


@lru_cache(maxsize=1024)
def rank_layers(spec, p: int, v: int = 1, schedule: str = "1f1b", seq_len: int = 4096) -> tuple:
    """Per pp rank: ``layers`` (block ids it holds), ``embedding`` / ``head`` (holds virtual stage 0 /
    the last), ``chunks`` (its virtual stages' block counts). Cached: treat the result as read-only."""
    stages = split_stages(spec, p, v, schedule, seq_len)
    last = len(stages) - 1
    out = []
    for ids in rank_chunks(p, v, schedule):
        out.append({"layers": tuple(i for c in ids for i in stages[c]), "embedding": 0 in ids,
                    "head": last in ids, "chunks": [len(stages[c]) for c in ids]})
    return tuple(out)
