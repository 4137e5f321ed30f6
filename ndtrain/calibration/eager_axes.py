"""ndtrain's eager CPU trainer on TP / CP / PP / EP layouts: one rank's model state, activation
peak and step time (the calibration of ``bench/planner_calibration.py``; ``eager.py`` and
``eager_time.py`` cover data parallel / ZeRO exactly, this module the other axes, approximately).

Model state (plain data parallel, ``zero_stage=0``, fp32 / fp64): 4 copies of the rank's
parameters (weights, gradients, two AdamW moments) + a 4-byte step counter per tensor, with the
rank's parameters from the layout (Megatron split, Shoeybi et al. 2019: q / k / v / w1 / w3 rows
and wo / w2 columns / tp, k / v replicated when tp > kv heads, the vocabulary padded to a multiple
of tp; the pipeline stage's blocks from the trainer's own split, ``parallel.pp.stage.plan_stage``;
E / ep routed experts per MoE layer).

Activations (``estimate_axes_activation_peak``): the eager per-layer bytes of ``eager.py`` on the
rank's local shapes (heads, kv heads, SwiGLU hidden and vocabulary / tp; tokens / cp), the head's
log-softmax tensors on the last stage, and, for pipelines, the trainer's schedule replayed action by
action (``parallel.pp.schedules.build_schedule``): F adds a microbatch-chunk's saved bytes, B frees
them (ZB-H1's split B keeps them and the gradients of every parameter-owning module's output until
W; Qi et al. 2023); the peak is the largest live sum plus the backward's transient. A MoE layer's
MLP keeps, per token, the top-k copies' SwiGLU tensors and the permuted input / output copies
(an estimate, not derived op by op like the dense layer). Not covered: ZeRO with these axes,
bf16, activation checkpointing, MLA, MTP.
"""
from __future__ import annotations

import math
from dataclasses import replace

from ndtrain.planner.eager import eager_layer_bytes


def local_spec(spec, tp: int):
    """``spec`` as one TP rank's tensors see it: heads, kv heads (at least 1), SwiGLU hidden, expert
    hidden and the padded vocabulary divided by tp."""
    if tp == 1:
        return spec
    return replace(spec, n_heads=spec.n_heads // tp, n_kv_heads=max(1, spec.n_kv_heads // tp),
                   ffn_hidden=spec.ffn_hidden // tp, moe_ffn_hidden=spec.moe_ffn_hidden // tp,
                   vocab_size=math.ceil(spec.vocab_size / tp))


def _is_moe(spec, i: int) -> bool:
    return spec.is_moe and i >= spec.first_dense_layers and (i - spec.first_dense_layers) % spec.moe_layer_freq == 0


def rank_layers(cfg, rank: int = 0) -> tuple[list[list[int]], bool, bool]:
    """(layer ids per chunk, holds the embedding, holds the head) of pipeline rank ``rank``."""
    if cfg.parallel.pp == 1:
        return [list(range(cfg.model.n_layers))], True, True
    from ndtrain.parallel.pp.stage import plan_stage

    info = plan_stage(cfg, rank)
    return [[int(i) for i in c] for c in info.chunks], info.first, info.last


def rank_param_counts(spec, cfg, rank: int = 0) -> tuple[int, int]:
    """(elements, tensors) of the parameters pipeline rank ``rank`` holds (TP / EP shards)."""
    p = cfg.parallel
    t, ep = p.tp, p.ep
    loc = local_spec(spec, t)
    h, D = spec.dim, spec.head_dim
    kv = loc.n_kv_heads * D
    chunks, first, last = rank_layers(cfg, rank)
    n, nt = 0, 0
    for i in (i for c in chunks for i in c):
        n += 2 * h + 2 * h * loc.n_heads * D + 2 * h * kv  # norms, wq + wo, wk + wv
        nt += 6
        if _is_moe(spec, i):
            n += spec.n_experts * h + spec.n_experts // ep * 3 * h * loc.moe_ffn_hidden
            nt += 4
            if spec.n_shared_experts:
                n += 3 * h * spec.n_shared_experts * loc.moe_ffn_hidden
                nt += 3
        else:
            n += 3 * h * loc.ffn_hidden
            nt += 3
    vocab_rows = loc.vocab_size
    if first:
        n, nt = n + vocab_rows * h, nt + 1
    if last:
        n, nt = n + h + (0 if spec.tie_embeddings and first else vocab_rows * h), nt + 2
    return n, nt


def estimate_axes_state_bytes(spec, cfg, rank: int = 0) -> dict:
    """Peak params / grads / optim bytes (and ``total``) of rank ``rank`` under plain DDP.
    Raises ValueError for ZeRO or a dtype other than float32 / float64."""
    if cfg.parallel.zero_stage or cfg.training.dtype not in ("float32", "float64"):
        raise ValueError("the axes state model covers zero_stage=0 in float32 / float64")
    m = 8 if cfg.training.dtype == "float64" else 4
    n, nt = rank_param_counts(spec, cfg, rank)
    out = {"params": m * n, "grads": m * n, "optim": 2 * m * n + 4 * nt}
    out["total"] = out["params"] + out["grads"] + out["optim"]
    return out


def _moe_mlp_per_token(spec, e: int = 4) -> float:
    """Bytes per token a MoE MLP keeps in eager fp32 (estimate): norm and router (E scores, softmax,
    top-k), the permuted input and weighted output of each top-k copy, each copy's SwiGLU tensors."""
    h, f, k = spec.dim, spec.moe_ffn_hidden, spec.top_k
    shared = 4 * e * spec.n_shared_experts * f
    return 3 * e * h + 4 + 3 * e * spec.n_experts + k * (4 * e * f + 3 * e * h) + shared


def _chunk_bytes(spec, layers, first, last, tokens, seq, tp, split) -> dict:
    """Per microbatch on one chunk: ``saved`` (kept from F to B), ``fwd`` / ``bwd`` (transients on top
    of everything live), ``grads`` (what split backward keeps from B to W), ``wgrads`` (W's transient:
    the chunk's weight gradients, all computed before one accumulating backward)."""
    e = 4
    loc = local_spec(spec, tp)
    lay = eager_layer_bytes(loc)
    h, f, V = spec.dim, loc.ffn_hidden, loc.vocab_size
    dense_tok, mlp_tok = lay["per_token"], lay["mlp_per_token"]
    saved = 2 * seq * (spec.head_dim // 2) * 4  # cos / sin at the positions
    grads, wgrads = 0.0, 0.0  # wgrads: the chunk's weight gradients, gathered by W before accumulating
    for i in layers:
        tok = dense_tok - mlp_tok + _moe_mlp_per_token(loc) if _is_moe(spec, i) else dense_tok
        saved += tok * tokens
        # outputs of wq, wk, wv, wo, w1, w3, w2 and the two norms (their gradients wait for W)
        q, k = loc.n_heads * loc.head_dim, loc.n_kv_heads * loc.head_dim
        grads += e * tokens * (q + 2 * k + 4 * h + 2 * f)
        mlp = 3 * h * (spec.n_experts * loc.moe_ffn_hidden if _is_moe(spec, i) else f)
        wgrads += e * (2 * h + h * (2 * q + 2 * k) + mlp)
    if first:
        saved += e * h * tokens
        grads += e * h * tokens
        wgrads += e * V * h
    fwd, bwd = 0.0, e * h * tokens + max(e * f * tokens + e * f * h, 2 * e * f * tokens)
    if last:  # final norm, the last block's output, the log-softmax result (fp32)
        saved += (8 * h + 4) * tokens + 4 * h * tokens + e * V * tokens
        grads += e * V * tokens
        wgrads += e * (V * h + h)
        fwd, bwd = e * V * tokens, max(bwd, 2 * e * V * tokens + e * V * h)
    else:
        saved += e * h * tokens  # the chunk's output, held by the runtime until its backward
    return {"saved": saved, "fwd": fwd, "bwd": bwd, "grads": grads if split else 0.0, "wgrads": wgrads}


def estimate_axes_activation_peak(spec, cfg, rank: int = 0, dp: int | None = None) -> dict:
    """Peak live activation bytes of one step on rank ``rank`` (what the trainer's meter measures
    over the whole step on a stage; ``dp``: data-parallel ranks, default from the config). Returns {"peak", "per_chunk", "schedule"}. Raises ValueError
    for activation checkpointing or a dtype other than float32."""
    from ndtrain.parallel.pp.schedules import build_schedule

    p, t = cfg.parallel, cfg.training
    if t.activation_checkpoint != "none" or t.dtype != "float32":
        raise ValueError("the axes activation model covers ac=none in float32")
    seq = cfg.data.seq_len // p.cp
    tokens = t.micro_batch_size * seq
    dp = dp or max(p.dp_shard, 1) * p.dp_replicate
    m = max(1, t.global_batch_size // (t.micro_batch_size * dp)) if p.pp > 1 else 1  # one stage: each microbatch's forward and backward run back to back
    chunks, first, last = rank_layers(cfg, rank)
    split = p.pp_schedule == "zero_bubble" and p.pp > 1
    per = [_chunk_bytes(spec, c, first and j == 0, last and j == len(chunks) - 1, tokens, seq, p.tp, split)
           for j, c in enumerate(chunks)]
    sched = build_schedule(p.pp_schedule if p.pp > 1 else "1f1b", max(p.pp, 1), m,
                           p.pp_virtual_stages if p.pp_schedule == "interleaved" else 1)
    live, peak = 0.0, 0.0
    for a in sched.actions[rank if p.pp > 1 else 0]:
        c = per[a.chunk]
        if a.kind == "F":
            peak = max(peak, live + c["saved"] + c["fwd"])
            live += c["saved"]
        elif a.kind == "B":
            peak = max(peak, live + c["bwd"])
            live += c["grads"] - (0.0 if split else c["saved"])
        else:  # W: the kept activations and output gradients go
            peak = max(peak, live + c["wgrads"])
            live -= c["saved"] + c["grads"]
    return {"peak": peak, "per_chunk": per, "schedule": sched.name}
