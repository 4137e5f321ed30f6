"""Per-rank memory: model state per ZeRO stage, activations per layer and per stage, buffers.

Model state (Rajbhandari et al. 2020, ZeRO, section 3; the lecture's 16 bytes/param): with P bytes
of parameters, G of gradients and K of optimizer state per parameter and N data-parallel shards,
ZeRO-1 keeps P + G + K/N, ZeRO-2 P + (G + K)/N, ZeRO-3 (P + G + K)/N. ``PRECISIONS`` holds the
conventions:

* ``mixed`` (P, G, K) = (2, 2, 12): bf16 weights and gradients, fp32 master weights and Adam m, v.
  This is the seed lecture's and the ZeRO paper's convention: 16 bytes/param; at N = 8 ZeRO-1/2/3
  give 4 + 12/8 = 5.5, 2 + 14/8 = 3.75 and 16/8 = 2 bytes/param.
* ``fp32`` (4, 4, 8): fp32 weights (the master copy) and gradients, Adam m, v; also 16 bytes/param
  but split differently: what ndtrain's trainer holds today (bf16 runs autocast from fp32 weights).
* ``lower_bound`` (2, 2, 4): the lecture's lower bound "4 numbers x 2 bytes = 8 bytes/param", with
  which 1B params take 8 GB, an 80 GB GPU holds ~10B params and 100B params sharded over 80 ranks
  take 800 GB / 80 = 10 GB each.

Activations per layer (bytes; Korthikanti et al. 2022 "Reducing Activation Recomputation in Large
Transformer Models", section 4, adapted): s tokens per rank (sequence / cp), b microbatch, h width,
a query heads, g kv heads, D head dim, f SwiGLU hidden, t TP degree, activations in bf16 (2 bytes):

    attention: 2sbh (norm in) + 2sbh (QKV in) + 2sbh*(a*D/h)/t (Q) + 4sb*g*D/t (K, V)
               + 2sb*a*D/t (attention out = O-proj in) + [2*a*s*s_kv*b/t scores, without flash]
    MLP:       2sbh (norm in) + 2sbh (gate/up in) + 4sbf/t (gate, up out) + 2sbf/t (SiLU(g)*u)

No dropout (Llama), so Korthikanti's masks vanish; SwiGLU replaces the 4h GELU MLP (its 19sbh) and
GQA shrinks K, V by g/a. With sequence parallelism every term is divided by t (without it the
replicated 2sbh terms are not: Korthikanti's 10 + 24/t split). MoE layers store the shared part as
above and, per routed copy (top-k), 2sbh dispatched in + 6sbf_e/t expert activations.
Policies: ``none``; ``full`` keeps each layer's input (2sbh/t with SP) and, while one block runs its
backward, that block's recomputed activations and their gradients (``backward_working``; without
recompute only the gradients);
``every:C`` checkpoints every C-th block (``sqrt``: C = round(sqrt L)); ``selective``
recomputes the attention core and SiLU(g)*u (Korthikanti's selective recompute).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from ndtrain.planner.layout import Layout, Workload, ac_every, microbatches
from ndtrain.planner.mixer_time import stage_mixers
from ndtrain.planner.pipeline import inflight_microbatches, rank_layers
from ndtrain.planner.trainer_memory import MEMORY_MODELS, trainer_loss_bytes, trainer_rank_breakdown

PRECISIONS = {  # bytes per parameter: (weights, gradients, optimizer state)
    "mixed": (2, 2, 12),
    "fp32": (4, 4, 8),
    "lower_bound": (2, 2, 4),
    "fp64": (8, 8, 16),  # float64 parity runs of the trainer
}


def estimate_state_bytes_per_param(zero_stage: int = 0, n_shards: int = 1, precision: str = "mixed") -> dict:
    """Bytes per parameter held by one rank for weights, gradients, optimizer state (and total).

    Raises ValueError for an unknown precision or a zero_stage outside 0..3.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; known: {', '.join(PRECISIONS)}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage ({zero_stage}) must be 0..3")
    p, g, k = PRECISIONS[precision]
    n = max(1, n_shards)
    out = {"params": p / n if zero_stage >= 3 else p, "grads": g / n if zero_stage >= 2 else g,
           "optimizer": k / n if zero_stage >= 1 else k}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def estimate_activation_bytes_per_layer(spec, tokens: int, seq_len: int, tp: int = 1, sp: bool = False,
                                        moe: bool = False, flash: bool = True, act_bytes: int = 2,
                                        policy: str = "none", implementation: str = "fused") -> dict:
    """Activation bytes one layer stores for one microbatch of ``tokens`` tokens on one rank
    (tokens = microbatch * seq_len / cp); ``seq_len`` is the full key length. Returns
    {"attention", "mlp", "input", "total"}; ``policy`` "selective" drops the recomputed parts.

    ``implementation``: "fused" (the table above: fused norm / SwiGLU / attention kernels, what
    Megatron-style GPU training keeps) or "eager" (ndtrain's model in eager PyTorch, derived from
    autograd's saved tensors in ``planner.eager``: act_bytes 4 = fp32, 8 = fp64, 2 = bf16 autocast
    over fp32 weights; dense, tp = 1, policy none only). Raises ValueError otherwise.
    """
    if implementation == "eager":
        if tp > 1 or moe or policy != "none" or act_bytes not in (2, 4, 8):
            raise ValueError("the eager activation model covers dense layers, tp = 1, policy none, "
                             "act_bytes 2 / 4 / 8")
        from ndtrain.planner.eager import eager_layer_bytes

        lay = eager_layer_bytes(spec, {2: "bfloat16", 4: "float32", 8: "float64"}[act_bytes])
        total = lay["per_token"] * tokens + lay["per_microbatch"] + lay["per_seq_pos"] * seq_len
        mlp = lay["mlp_per_token"] * tokens
        res = 8 if act_bytes == 8 else 4
        return {"attention": total - mlp, "mlp": mlp, "input": res * tokens * spec.dim, "total": total}
    if implementation != "fused":
        raise ValueError(f"implementation must be fused or eager, not {implementation!r}")
    h, a, g, D = spec.dim, spec.n_heads, spec.n_kv_heads, spec.head_dim
    e, t = act_bytes, tp
    r = 1.0 / t if sp else 1.0  # residual-stream tensors: sharded by SP, else replicated
    kv_local = max(g / t, 1.0)  # kv heads per TP rank (replicated when tp > g)
    dv = spec.v_head_dim or D
    attn = e * tokens * h * r * 2 + e * tokens * a * D / t + 2 * e * tokens * kv_local * D \
        + e * tokens * a * dv / t
    if flash:
        attn += 4 * tokens * a / t  # fp32 logsumexp per query and head
    elif policy != "selective":
        attn += e * a * tokens * seq_len / t  # softmax output over all keys
    if moe and spec.is_moe:
        f_sh = spec.n_shared_experts * spec.shared_ffn_hidden
        mlp = e * tokens * h * r * 2 + 4 * tokens * spec.n_experts * r  # + fp32 router logits
        routed = e * tokens * h * r * 2 + e * tokens * 3 * spec.moe_ffn_hidden / t  # per copy
        mlp += e * tokens * 3 * f_sh / t + spec.top_k * routed
        if policy == "selective":
            mlp -= e * tokens * (f_sh + spec.top_k * spec.moe_ffn_hidden) / t
    else:
        f = spec.ffn_hidden
        mlp = e * tokens * h * r * 2 + e * tokens * 3 * f / t
        if policy == "selective":
            mlp -= e * tokens * f / t
    inp = e * tokens * h * r
    return {"attention": attn, "mlp": mlp, "input": inp, "total": attn + mlp}


@dataclass
class MemoryEstimate:
    """Per-rank bytes on the peak pipeline rank (``stage``); ``breakdown`` sums to ``total``;
    ``per_stage``: the total of every pp rank (bytes)."""

    breakdown: dict = field(default_factory=dict)
    total: float = 0.0
    capacity: float = 0.0
    stage: int = 0
    per_stage: list = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


def stage_params(spec, stage_layers, stage: int) -> dict:
    """Parameter counts of pipeline stage ``stage`` from contiguous block counts per stage."""
    first = sum(stage_layers[:stage])
    ids = tuple(range(first, first + stage_layers[stage]))
    return rank_params(spec, ids, stage == 0, stage == len(stage_layers) - 1, len(stage_layers))


@lru_cache(maxsize=8192)
def rank_params(spec, layers: tuple, embedding: bool, head: bool, n_stages: int = 2) -> dict:
    """Parameter counts (whole, before TP / EP) on a rank holding blocks ``layers`` and, if asked,
    the embedding / the final norm + head (+ the MTP modules, which sit after the last block):
    dense and expert parts, and its MoE / dense block counts. A tied head is a copy when pp > 1; so is
    the embedding MTP reads on a head stage that does not hold it (``model/mtp.py``)."""
    moe = sum(1 for i in layers if spec.is_moe and i >= spec.first_dense_layers
              and (i - spec.first_dense_layers) % spec.moe_layer_freq == 0)
    dense_layers = len(layers) - moe
    dense = dense_layers * spec.layer_params(False)
    expert = moe * spec.n_experts * spec.expert_params
    dense += moe * (spec.layer_params(True) - spec.n_experts * spec.expert_params)
    if embedding:
        dense += spec.embedding_params
    if head:
        tied_here = spec.tie_embeddings and embedding
        dense += spec.dim + (0 if tied_here else spec.vocab_size * spec.dim)
        mtp_expert = spec.mtp_depth * spec.n_experts * spec.expert_params if spec.last_layer_is_moe else 0
        dense += spec.mtp_params() - mtp_expert
        expert += mtp_expert
        if spec.mtp_depth and not embedding and not spec.tie_embeddings:  # MTP's embedding copy (pp > 1)
            dense += spec.embedding_params
    return {"dense": dense, "expert": expert, "moe_layers": moe, "dense_layers": dense_layers}


def estimate_memory(spec, workload: Workload, layout: Layout, capacity: float, reserve: float = 0.0,
                    allocator_overhead: float = 1.0) -> MemoryEstimate:
    """Peak per-rank memory over every pipeline rank, each from its own blocks (dense, MoE, MTP,
    embedding, head; ``pipeline.rank_layers``: the trainer's split) and its own in-flight
    microbatches under the schedule. ZeRO shards over dp_shard x cp; experts split over ep x tp
    (ep x expert_tp on the folded expert mesh) and shard over ``Layout.expert_shards``.
    ``reserve``: runtime bytes (CUDA context, NCCL buffers);
    ``allocator_overhead``: factor on the transient bytes (the loss buffers and one block's backward
    working set), the short-lived large blocks that fragment PyTorch's caching allocator.
    ``workload.memory_model``: "fused" (this module's model) or "trainer" (``trainer_memory``:
    ndtrain's eager modules, what the rehearsal measures). Raises ValueError if the layers cannot
    fill the pipeline stages or for an unknown memory model."""
    lay, w = layout, workload
    if w.memory_model not in MEMORY_MODELS:
        raise ValueError(f"memory_model must be one of {', '.join(MEMORY_MODELS)}, not {w.memory_model!r}")
    m = microbatches(lay, w)
    tokens = lay.microbatch * w.seq_len // lay.cp
    per_layer = _per_layer_activations(spec, w, lay, tokens)
    ranks = rank_layers(spec, lay.pp, lay.pp_virtual_stages, lay.pp_schedule, w.seq_len)
    best, totals, cache = None, [], {}
    for r, info in enumerate(ranks):
        inflight = inflight_microbatches(lay.pp, m, lay.pp_schedule, lay.pp_virtual_stages, stage=r)
        prm = rank_params(spec, info["layers"], info["embedding"], info["head"], len(ranks))
        # ranks alike by counts (zero_bubble: the W gradients a rank holds grow with its index)
        key = (tuple(prm.values()), info["embedding"], info["head"], inflight,
               r if lay.pp_schedule == "zero_bubble" else 0, stage_mixers(spec, info["layers"]))
        if key not in cache:
            bd = _rank_breakdown(spec, w, lay, info, inflight, tokens, per_layer, len(ranks), m, r)
            if allocator_overhead != 1.0:
                transient = bd.get("backward_working", 0.0) + bd.get("logits", 0.0)
                bd["allocator_overhead"] = (allocator_overhead - 1.0) * transient
            bd["runtime_reserve"] = reserve
            cache[key] = bd
        bd = cache[key]
        totals.append(sum(bd.values()))
        if best is None or totals[-1] > best.total:
            best = MemoryEstimate(dict(bd), totals[-1], capacity, r)
    best.per_stage = totals
    return best


def _rank_breakdown(spec, w: Workload, lay: Layout, info: dict, inflight: float, tokens: int,
                    per_layer: dict, n_ranks: int, n_micro: int = 1, stage: int = 0) -> dict:
    """Model state, ZeRO buffers, activations and loss bytes of one pp rank (``w.memory_model``
    "trainer": ``trainer_memory.trainer_rank_breakdown``)."""
    n_shard = lay.dp_shard * lay.cp
    pb, gb, _ = PRECISIONS[w.precision]
    prm = rank_params(spec, info["layers"], info["embedding"], info["head"], n_ranks)
    if w.memory_model == "trainer":
        n_layers, n_moe = _block_counts(spec, info, prm)
        return trainer_rank_breakdown(spec, w, lay, prm, n_layers, n_moe, info["head"], inflight, n_micro, tokens,
                                      layers=tuple(info["layers"]), stage=stage, embedding=info["embedding"])
    dense_local = prm["dense"] / lay.tp
    expert_local = prm["expert"] / (lay.etp * lay.ep)
    bd = {}
    for part, count, shards in (("dense", dense_local, n_shard), ("expert", expert_local, lay.expert_shards)):
        per = estimate_state_bytes_per_param(lay.zero_stage, shards, w.precision)
        for k in ("params", "grads", "optimizer"):
            bd[k] = bd.get(k, 0.0) + count * per[k]
    n_layers, n_moe = _block_counts(spec, info, prm)
    if lay.zero_stage == 3 and n_layers:  # gathered current + prefetched block, one block's full grads
        bd["zero3_buffers"] = spec.rank_block_params(n_moe > 0, lay.tp, lay.ep, lay.etp) * (2 * pb + gb)
    if w.precision == "fp32" and w.act_bytes == 2:  # autocast's bf16 weight copies, kept for bwd
        bd["param_casts"] = 2 * (dense_local + expert_local) / (n_shard if lay.zero_stage == 3 else 1)
    act = _stage_activations(spec, lay, per_layer, n_layers, n_moe)
    bd["activations"] = act["stored"] * inflight
    if act["working"]:
        bd["backward_working"] = act["working"]
    if info["head"]:
        bd["logits"] = (trainer_loss_bytes(spec, tokens, lay.tp, True) if w.fused_loss
                        else loss_bytes(spec, tokens, lay.tp, w.act_bytes))
    return bd


def _block_counts(spec, info: dict, prm: dict) -> tuple[int, int]:
    """(blocks, MoE blocks) a pp rank runs per microbatch: each MTP depth runs one more block like
    the last one."""
    n_layers, n_moe = len(info["layers"]), prm["moe_layers"]
    if info["head"] and spec.mtp_depth:
        n_layers += spec.mtp_depth
        n_moe += spec.mtp_depth if spec.last_layer_is_moe else 0
    return n_layers, n_moe


def loss_bytes(spec, tokens: int, tp: int = 1, act_bytes: int = 2) -> float:
    """Bytes the output head and cross entropy hold for one microbatch of ``tokens`` tokens: per
    head pass (1 + MTP depth) the logits (``act_bytes``) and the fp32 log-probabilities kept for
    backward, plus one fp32 upcast of the logits (cross entropy in fp32) and, in backward, one fp32
    logits gradient; vocabulary split over ``tp`` (vocab-parallel loss)."""
    per_logit = tokens * spec.vocab_size / tp
    return per_logit * ((act_bytes + 4) * (1 + spec.mtp_depth) + 4 + 4)


def _per_layer_activations(spec, w: Workload, lay: Layout, tokens: int) -> dict:
    kw = {"tokens": tokens, "seq_len": w.seq_len, "tp": lay.tp, "sp": lay.seq_parallel, "flash": w.flash,
          "act_bytes": w.act_bytes, "policy": "selective" if lay.ac == "selective" else "none"}
    dense = estimate_activation_bytes_per_layer(spec, moe=False, **kw)
    moe = estimate_activation_bytes_per_layer(spec, moe=True, **kw) if spec.is_moe else dense
    if lay.ac in ("op", "core_attn", "deepseek"):  # the other per-layer policies: planner.ac_memory
        from ndtrain.planner.ac_memory import policy_layer_bytes

        args = (spec, tokens, w.seq_len, lay.tp, lay.seq_parallel)
        dense = policy_layer_bytes(dense, *args, False, w.flash, w.act_bytes, lay.ac)
        moe = policy_layer_bytes(moe, *args, spec.is_moe, w.flash, w.act_bytes, lay.ac) if spec.is_moe else dense
    return {"dense": dense, "moe": moe}


def _stage_activations(spec, lay: Layout, per_layer: dict, n_layers: int, n_moe: int) -> dict:
    """Bytes one microbatch leaves stored on a rank (``stored``) and the transient working set of
    one block's backward (``working``): the gradients of its activations (about their size), plus
    under recompute the recomputed activations themselves; by the layout's checkpointing policy."""
    per_dense, per_moe = per_layer["dense"], per_layer["moe"]
    full = (n_layers - n_moe) * per_dense["total"] + n_moe * per_moe["total"]
    biggest = max(per_dense["total"], per_moe["total"] if n_moe else 0.0)
    inp = per_dense["input"]
    if lay.ac in ("none", "selective", "op", "core_attn", "deepseek") or n_layers == 0:  # per-layer policies
        return {"stored": full, "working": biggest if n_layers else 0.0}
    if lay.ac == "full":
        return {"stored": n_layers * inp, "working": 2 * biggest}
    c = ac_every(lay.ac, spec.n_layers)
    n_ck = -(-n_layers // c)  # checkpointed blocks: every C-th one
    avg = full / n_layers
    return {"stored": n_ck * inp + (n_layers - n_ck) * avg, "working": 2 * biggest}


def recompute_fraction(ac: str, n_layers: int) -> float:
    """Share of the blocks whose forward is run again in backward (selective: 0, see timing)."""
    if ac == "full":
        return 1.0
    c = ac_every(ac, n_layers)
    return 1.0 / c if c else 0.0
