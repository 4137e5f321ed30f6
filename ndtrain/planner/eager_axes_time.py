"""Step time of ndtrain's eager CPU trainer on TP / CP / PP / EP layouts, from component rates
measured at one rank's local shapes (``rate_spec`` -> ``measure_eager.measure_eager_rates``) and
the measured gloo constants; never fitted to a training run.

Per microbatch on the slowest pipeline stage (its own blocks, the embedding on the first, the
final norm and cross entropy on the last):

    t_mb = t_gemm(stage FLOPs / tp) + L_stage x (t_attn + 2 t_norm + t_rope + t_swiglu + 2 t_add)
           [+ t_norm + t_loss on the last stage] + t_comm(tp, cp, ep, pp)

Every blocking collective costs ``alpha`` per ring step plus its bytes / ``beta``. On this machine's
one-thread ranks ``alpha`` is not gloo's idle latency (tens of microseconds) but what a blocking
collective adds to ranks that compute between collectives (``measure.measure_sync_latency``:
waiting for the peer whose compute jittered, then being woken by gloo's transport thread; about a
millisecond). That cost, times the number of collectives a layout issues, is what TP and EP pay and
PP / DP (a few collectives per step) do not; the counts below are those the trainer issues (its
flight recorder, ``ndtrain.parallel.flight_recorder``, lists the same per step).

* TP (Shoeybi et al. 2019, no SP): per block two all-reduces of the (s, h) activation forward (row
  linears) and two backward (the regions' inputs); one for the vocabulary-parallel embedding on the
  first stage; on the last the head input's gradient and the vocabulary-parallel cross entropy's
  max and (sum-exp, target logit) all-reduces.
* CP ring (Liu et al. 2023, ``ndtrain.parallel.cp.ring``): per block cp - 1 K / V exchanges
  forward, cp - 1 K / V and cp dK / dV accumulator exchanges backward; the rank computes cp
  (load-balanced) blocks of explicit attention (scores materialised, online-softmax merge), timed
  as ``ring_attn_s`` (``measure_eager``: the ring's own block functions at the local shapes), not
  as the fused causal kernel the other layouts use.
* EP (GShard, ``ndtrain.parallel.ep.layers``): per MoE block an all-to-all of the per-expert counts,
  then dispatch + combine all-to-alls of the top-k copies forward and their gradients backward.
  A MoE block's feed-forward is ``moe_mlp_s``: the model's own MoE module (router, top-k, sort,
  experts over the k x N routed rows, combine) timed on one process at the rank's tokens
  (``measure_eager``); the rest of the block as a dense one. Not timed: EP's second regrouping of
  the received rows by local expert; MoE under TP (the module is timed at full width).
* PP: one send of the (s, h) activation per microbatch and stage boundary each way.

Step: ``(m + bubble slots) x t_mb`` (the planner's ``pipeline.bubble_slots`` of the schedule; gloo
collectives and sends are not overlapped on CPU), + the per-parameter passes over the rank's
parameters (AdamW, clip, accumulation, DP bucket copies) + the data-parallel all-reduce of the
gradients (ring alpha-beta per bucket; EP: the experts' gradients reduce over dp / ep ranks) + the
step's one world all-reduce (loss / norm statistics).
"""
from __future__ import annotations

from dataclasses import replace

from ndtrain.planner.eager_axes import local_spec, rank_layers, rank_param_counts
from ndtrain.planner.eager_time import BLOCK_COMPONENTS, linear_shapes
from ndtrain.planner.pipeline import bubble_slots


def rate_spec(spec, cfg):
    """The dense spec whose eager components, timed at (micro batch, seq_len / cp) tokens, are one
    rank's: TP's local heads / hidden / vocabulary; a MoE model as a dense one with a SwiGLU of
    top_k x the expert hidden."""
    loc = local_spec(spec, cfg.parallel.tp)
    if loc.is_moe:
        loc = replace(loc, ffn_hidden=loc.top_k * loc.moe_ffn_hidden, n_experts=0, top_k=0, moe_ffn_hidden=0,
                      n_shared_experts=0, first_dense_layers=0)
    return loc


def _ring_all_reduce(n: int, nbytes: float, alpha: float, beta: float) -> float:
    return 0.0 if n <= 1 else 2 * (n - 1) / n * nbytes / beta + 2 * (n - 1) * alpha


def collectives_per_microbatch(spec, cfg, rank: int) -> dict:
    """Blocking collectives one microbatch's forward + backward issues on pipeline rank ``rank``, by
    mesh axis (the names of the trainer's flight recorder): ``tp`` all-reduces, ``cp`` ring
    exchanges, ``ep`` all-to-alls, ``pp`` sends per virtual chunk (see the module docstring)."""
    p = cfg.parallel
    chunks, first, last = rank_layers(cfg, rank)
    n_layers = sum(len(c) for c in chunks)
    n_moe = sum(1 for c in chunks for i in c if spec.is_moe and i >= spec.first_dense_layers
                and (i - spec.first_dense_layers) % spec.moe_layer_freq == 0)
    return {"tp": 4 * n_layers + (1 if first else 0) + (3 if last else 0) if p.tp > 1 else 0,
            "cp": n_layers * (3 * p.cp - 2) if p.cp > 1 else 0,
            "ep": 5 * n_moe if p.ep > 1 else 0,
            "pp": 2 * ((0 if first else 1) + (0 if last else 1)) if p.pp > 1 else 0}


def collectives_per_step(spec, cfg, rank: int, m: int) -> dict:
    """``collectives_per_microbatch`` x ``m`` microbatches, + the step's own: the gradient clip's
    all-reduce of the squared norm over each axis that shards parameters (tp, ep)."""
    p = cfg.parallel
    per = collectives_per_microbatch(spec, cfg, rank)
    return {a: m * n + (1 if a in ("tp", "ep") and getattr(p, a) > 1 else 0) for a, n in per.items()}


def stage_microbatch_seconds(spec, cfg, rates: dict, rank: int, alpha: float, beta: float) -> dict:
    """Seconds of one microbatch's forward + backward on pipeline rank ``rank``, by part."""
    p, t = cfg.parallel, cfg.training
    loc = rate_spec(spec, cfg)
    chunks, _, last = rank_layers(cfg, rank)
    n_layers = sum(len(c) for c in chunks)
    tokens = t.micro_batch_size * cfg.data.seq_len // p.cp
    e = 8 if t.dtype == "float64" else 4
    mm = sum(a * b * c for a, b, c in linear_shapes(replace(loc, n_layers=n_layers)))
    if not last:
        mm -= loc.dim * loc.vocab_size
    # the ring runs its own explicit block attention (per rank and layer: ring_attn_s), not the kernel
    comps = dict(BLOCK_COMPONENTS, attn=0) if p.cp > 1 else BLOCK_COMPONENTS
    ring = rates["ring_attn_s"] if p.cp > 1 else 0.0
    n = collectives_per_microbatch(spec, cfg, rank)
    blocks = n_layers * (ring + sum(c * rates[f"{k}_s"] for k, c in comps.items()))
    if spec.is_moe:  # MoE blocks: the model's MoE module as timed, not a dense SwiGLU's GEMMs
        n_moe = sum(1 for c in chunks for i in c if i >= spec.first_dense_layers
                    and (i - spec.first_dense_layers) % spec.moe_layer_freq == 0)
        mm -= n_moe * 3 * loc.dim * loc.ffn_hidden
        blocks += n_moe * (rates["moe_mlp_s"] - rates["swiglu_s"])
    out = {"gemm": 6.0 * tokens * mm / rates["gemm_flops_per_s"], "blocks": blocks,
           "head": (rates["norm_s"] + rates["loss_s"]) if last else 0.0}
    act = e * tokens * spec.dim
    out["tp_comm"] = n["tp"] * _ring_all_reduce(p.tp, act, alpha, beta)
    kv = 2 * e * tokens * loc.n_kv_heads * loc.head_dim  # K and V stacked (dK / dV: the same bytes)
    out["cp_comm"] = n["cp"] * (kv / beta + alpha)
    # the top-k copies each way (4 of the 5; the counts' all-to-all is a few bytes)
    a2a = e * tokens * spec.top_k * spec.dim * (p.ep - 1) / max(p.ep, 1)
    out["ep_comm"] = 4 * n["ep"] / 5 * a2a / beta + n["ep"] * (p.ep - 1) * alpha
    out["pp_comm"] = p.pp_virtual_stages * n["pp"] * (act / beta + alpha)
    return out


def estimate_axes_step_time(spec, cfg, rates: dict, world: int, alpha: float = 0.0,
                            beta: float = float("inf")) -> dict:
    """Seconds of one optimizer step (``step_time_s``) and its ``parts`` (see module docstring) on the
    slowest rank of a TP / CP / PP / EP layout of ``world`` processes. ``rates``: measured at
    ``rate_spec``'s shapes with the layout's processes (``ring_attn_s`` too when cp > 1);
    ``alpha``: seconds per ring step of a blocking collective (``measure.measure_sync_latency``),
    ``beta``: bytes/s. Raises KeyError for a missing rate, ValueError for Ulysses CP."""
    p, t = cfg.parallel, cfg.training
    if p.cp > 1 and p.cp_impl != "ring":
        raise ValueError(f"the eager axes model covers ring context parallelism, not cp_impl={p.cp_impl!r}")
    dp = world // (p.pp * p.cp * p.tp)
    m = max(1, t.global_batch_size // (t.micro_batch_size * dp))
    per = [stage_microbatch_seconds(spec, cfg, rates, r, alpha, beta) for r in range(p.pp)]
    slow = max(range(p.pp), key=lambda r: sum(per[r].values()))
    t_mb = sum(per[slow].values())
    v = p.pp_virtual_stages if p.pp_schedule == "interleaved" else 1
    slots = bubble_slots(p.pp, p.pp_schedule, v)
    parts = {k: m * x for k, x in per[slow].items()}
    parts["bubble"] = slots * t_mb
    n, _ = rank_param_counts(spec, cfg, slow)
    e = 8 if t.dtype == "float64" else 4
    expert = 0
    if spec.is_moe:
        expert = sum(3 * spec.dim * spec.moe_ffn_hidden // p.tp * spec.n_experts // p.ep
                     for i in range(spec.n_layers) if i >= spec.first_dense_layers
                     and (i - spec.first_dense_layers) % spec.moe_layer_freq == 0)
    passes = {"optim": n, "clip": n, "accum": n * (m - 1), "copy": n if dp > 1 else 0}
    parts["param_passes"] = sum(c * rates[f"{k}_s_per_param"] for k, c in passes.items())
    parts["dp_comm"] = (_ring_all_reduce(dp, e * (n - expert), alpha, beta)
                        + _ring_all_reduce(dp // max(p.ep, 1), e * expert, alpha, beta)
                        + _ring_all_reduce(world, 16, alpha, beta))  # the step's world all-reduce
    for a in ("tp", "ep"):  # the clip's norm over the axes that shard parameters
        parts[f"{a}_comm"] += _ring_all_reduce(getattr(p, a), 8, alpha, beta)
    return {"step_time_s": sum(parts.values()), "parts": parts, "microbatches": m, "slowest_rank": slow}
