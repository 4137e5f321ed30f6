"""Step time of ndtrain's eager CPU trainer on TP / CP / PP / EP layouts, from component rates
measured at one rank's local shapes (``rate_spec`` -> ``measure_eager.measure_eager_rates``) and
the measured gloo constants; never fitted to a training run.

Per microbatch on the slowest pipeline stage (its own blocks, the embedding on the first, the
final norm and cross entropy on the last):

    t_mb = t_gemm(stage FLOPs / tp) + L_stage x (t_attn + 2 t_norm + t_rope + t_swiglu + 2 t_add
           [+ 2 t_tp_region]) [+ t_norm + t_loss (TP: t_tp_loss) on the last stage]
           [+ t_tp_embed on the first] + t_comm(tp, cp, ep, pp)

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
  max and (sum-exp, target logit) all-reduces. The TP layers' own eager work is timed from their
  code at the rank's shapes with the collectives off (``measure_eager._tp_components``): f / g's
  activation copies, 2 regions per block (``tp_region_s``), the vocabulary-parallel loss in place
  of the single-device one (``tp_loss_s``) and embedding (``tp_embed_s``, first stage).

Measured collective cost (``<axis>_collective_s`` for tp, cp, ep, when given): one blocking
all-reduce of the axis's message (``_axis_message_bytes``) between ranks that compute
``axis_collective_gap`` seconds between collectives, measured on this machine right before and
after the run (``measure.measure_sync_latency(nbytes, gap_s)``), replaces ``2 alpha + bytes /
beta`` for each collective of that axis. On shared cores the wait for the peer grows with the
compute in between (the ranks' jitter), so a layout whose collectives are ~8 ms apart pays more
per collective than the ~1 ms loop that measures the default ``alpha``. For a CP exchange or an
EP all-to-all the all-reduce of the same bytes per rank stands in for the operation.
* CP ring (Liu et al. 2023, ``ndtrain.parallel.cp.ring``): per block cp - 1 K / V exchanges
  forward, cp - 1 K / V and cp dK / dV accumulator exchanges backward; the rank computes cp
  (load-balanced) blocks of explicit attention (scores materialised, online-softmax merge), timed
  as ``ring_attn_s`` (``measure_eager``: the ring's own block functions at the local shapes), not
  as the fused causal kernel the other layouts use.
* EP (GShard, ``ndtrain.parallel.ep.layers``): per MoE block an all-to-all of the per-expert counts,
  then dispatch + combine all-to-alls of the top-k copies forward and their gradients backward.
  A MoE block's feed-forward is ``moe_mlp_s``: the MoE layer as a rank runs it, through
  ``ExpertParallelExperts`` (route, sort, count exchange, regroup by local expert, the E / ep
  local experts over the k x N rows of the mean load, inverse regroup, combine), the all-to-alls
  as local copies (``measure_ep.ep_moe_seconds``); the rest of the block as a dense one.
  Skewed routing (``rates["moe_imbalance"]`` = f, the busiest ep rank's received rows / the
  mean, default 1; ``measure_ep.measure_ep_imbalance`` replays a run's routing): the busiest
  rank's experts run f x the mean rows and every rank waits for them at the combine (forward and
  backward), ``ep_imbalance`` = (f - 1) x ``moe_experts_s`` (the local experts alone) per MoE
  block, and the 4 token all-to-alls carry (f - 1) x the mean bytes more. Not modelled: MoE under
  TP (the module is timed at full width).
* PP: one send of the (s, h) activation per microbatch and stage boundary each way.

Step: ``(m + bubble slots) x t_mb`` (the planner's ``pipeline.bubble_slots`` of the schedule; gloo
collectives and sends are not overlapped on CPU), + the per-parameter passes over the rank's
parameters (AdamW, clip, accumulation, DP bucket copies) + the data-parallel all-reduce of the
gradients (ring alpha-beta per bucket; EP: the experts' gradients reduce over dp / ep ranks) + the
step's one world all-reduce (loss / norm statistics).
"""
from __future__ import annotations

from dataclasses import replace

from ndtrain.calibration.eager_axes import local_spec, rank_layers, rank_param_counts
from ndtrain.calibration.eager_time import BLOCK_COMPONENTS, linear_shapes
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
    chunks, first, last = rank_layers(cfg, rank)
    n_layers = sum(len(c) for c in chunks)
    tokens = t.micro_batch_size * cfg.data.seq_len // p.cp
    mm = sum(a * b * c for a, b, c in linear_shapes(replace(loc, n_layers=n_layers)))
    if not last:
        mm -= loc.dim * loc.vocab_size
    # the ring runs its own explicit block attention (per rank and layer: ring_attn_s), not the kernel
    comps = dict(BLOCK_COMPONENTS, attn=0) if p.cp > 1 else BLOCK_COMPONENTS
    ring = rates["ring_attn_s"] if p.cp > 1 else 0.0
    n = collectives_per_microbatch(spec, cfg, rank)
    # TP's own layers: f / g around the two regions of a block, the vocabulary-parallel loss and embedding
    tp_region = 2 * rates["tp_region_s"] if p.tp > 1 else 0.0
    blocks = n_layers * (ring + tp_region + sum(c * rates[f"{k}_s"] for k, c in comps.items()))
    n_moe, imb = 0, 0.0
    if spec.is_moe:  # MoE blocks: the model's MoE module as timed, not a dense SwiGLU's GEMMs
        n_moe = sum(1 for c in chunks for i in c if i >= spec.first_dense_layers
                    and (i - spec.first_dense_layers) % spec.moe_layer_freq == 0)
        mm -= n_moe * 3 * loc.dim * loc.ffn_hidden
        blocks += n_moe * (rates["moe_mlp_s"] - rates["swiglu_s"])
        imb = max(1.0, rates.get("moe_imbalance", 1.0)) - 1.0 if p.ep > 1 else 0.0
    loss = rates["tp_loss_s"] if p.tp > 1 else rates["loss_s"]
    out = {"gemm": 6.0 * tokens * mm / rates["gemm_flops_per_s"], "blocks": blocks,
           "head": (rates["norm_s"] + loss if last else 0.0) + (rates["tp_embed_s"] if p.tp > 1 and first else 0.0)}
    msg = _axis_message_bytes(spec, cfg)
    out["tp_comm"] = n["tp"] * _ring_all_reduce(p.tp, msg["tp"], alpha, beta)
    out["cp_comm"] = n["cp"] * (msg["cp"] / beta + alpha)
    # the top-k copies each way (4 of the 5; the counts' all-to-all is a few bytes)
    out["ep_comm"] = 4 * n["ep"] / 5 * msg["ep"] / beta + n["ep"] * (p.ep - 1) * alpha
    for a in ("tp", "cp", "ep"):  # measured at this layout's message and compute gap, when given
        if f"{a}_collective_s" in rates:
            out[f"{a}_comm"] = n[a] * rates[f"{a}_collective_s"]
    # skewed routing: every rank waits for the busiest one's experts (forward and backward), whose
    # token all-to-alls also carry imb x more rows than the mean
    out["ep_imbalance"] = n_moe * imb * rates["moe_experts_s"] if imb else 0.0
    out["ep_comm"] += 4 * n["ep"] / 5 * imb * msg["ep"] / beta
    out["pp_comm"] = p.pp_virtual_stages * n["pp"] * (msg["tp"] / beta + alpha)
    return out


def _axis_message_bytes(spec, cfg) -> dict:
    """Bytes one rank sends per blocking collective of each axis: ``tp`` the (s, h) activation
    all-reduced (also what a pipeline send carries), ``cp`` one K / V block (K and V stacked; dK /
    dV the same), ``ep`` the top-k copies that leave the rank in a dispatch or combine."""
    p, t = cfg.parallel, cfg.training
    e = 8 if t.dtype == "float64" else 4
    tokens = t.micro_batch_size * cfg.data.seq_len // p.cp
    loc = local_spec(spec, p.tp)
    return {"tp": e * tokens * spec.dim, "cp": 2 * e * tokens * loc.n_kv_heads * loc.head_dim,
            "ep": e * tokens * spec.top_k * spec.dim * (p.ep - 1) / max(p.ep, 1)}


def axis_collective_gap(spec, cfg, rates: dict, axis: str = "tp") -> dict:
    """Where a rank's blocking collectives of ``axis`` (tp, cp or ep) sit, for measuring their cost
    on this machine (``measure.measure_sync_latency(nbytes=..., gap_s=...)`` ->
    ``rates["<axis>_collective_s"]``): ``nbytes`` one such collective moves (``_axis_message_bytes``)
    and ``gap_s``, the predicted compute of a microbatch on the slowest stage (matmuls, components,
    the axes' own layers; no communication) divided by its collectives of any axis: the mean
    compute between two blocking collectives. Raises ValueError when the layout has no collective
    on ``axis``, KeyError for a missing rate."""
    p = cfg.parallel
    if getattr(p, axis) == 1:
        raise ValueError(f"axis_collective_gap({axis!r}) needs parallel.{axis} > 1")
    rates = {k: v for k, v in rates.items() if not k.endswith("_collective_s")}
    gaps = []
    for r in range(p.pp):
        part = stage_microbatch_seconds(spec, cfg, rates, r, 0.0, float("inf"))
        n = collectives_per_microbatch(spec, cfg, r)
        gaps.append((part["gemm"] + part["blocks"] + part["head"]) / max(1, n["tp"] + n["cp"] + n["ep"]))
    return {"gap_s": max(gaps), "nbytes": int(_axis_message_bytes(spec, cfg)[axis])}


def estimate_axes_step_time(spec, cfg, rates: dict, world: int, alpha: float = 0.0,
                            beta: float = float("inf")) -> dict:
    """Seconds of one optimizer step (``step_time_s``) and its ``parts`` (see module docstring) on the
    slowest rank of a TP / CP / PP / EP layout of ``world`` processes. ``rates``: measured at
    ``rate_spec``'s shapes with the layout's processes (``ring_attn_s`` too when cp > 1);
    ``alpha``: seconds per ring step of a blocking collective (``measure.measure_sync_latency``),
    ``beta``: bytes/s; ``rates["moe_imbalance"]`` (optional, >= 1) the EP routing skew. Raises
    KeyError for a missing rate (``moe_experts_s`` when the skew is > 1), ValueError for Ulysses CP."""
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
