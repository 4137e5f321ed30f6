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
Policies: ``none``; ``full`` keeps each layer's input (2sbh/t with SP) and one layer's working set;
``every:C`` checkpoints every C-th block (issue 3; ``sqrt``: C = round(sqrt L)); ``selective``
recomputes the attention core and SiLU(g)*u (Korthikanti's selective recompute).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from ndtrain.planner.layout import Layout, Workload, ac_every, microbatches
from ndtrain.planner.pipeline import inflight_microbatches

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
    """Per-rank bytes on the peak stage; ``breakdown`` sums to ``total``."""

    breakdown: dict = field(default_factory=dict)
    total: float = 0.0
    capacity: float = 0.0
    stage: int = 0

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


def stage_params(spec, stage_layers, stage: int) -> dict:
    return _stage_params(spec, tuple(stage_layers), stage)


@lru_cache(maxsize=4096)
def _stage_params(spec, stage_layers: tuple, stage: int) -> dict:
    """Parameter counts on one pipeline stage (whole, before TP / EP): dense and expert parts."""
    first = sum(stage_layers[:stage])
    idx = range(first, first + stage_layers[stage])
    moe = sum(1 for i in idx if spec.is_moe and i >= spec.first_dense_layers
              and (i - spec.first_dense_layers) % spec.moe_layer_freq == 0)
    dense_layers = len(idx) - moe
    dense = dense_layers * spec.layer_params(False)
    expert = moe * spec.n_experts * spec.expert_params
    dense += moe * (spec.layer_params(True) - spec.n_experts * spec.expert_params)
    if stage == 0:
        dense += spec.embedding_params
    if stage == len(stage_layers) - 1:  # final norm + head (a tied head is a copy when pp > 1)
        tied_here = spec.tie_embeddings and len(stage_layers) == 1
        dense += spec.dim + (0 if tied_here else spec.vocab_size * spec.dim)
        mtp_expert = spec.mtp_depth * spec.n_experts * spec.expert_params if spec.last_layer_is_moe else 0
        dense += spec.mtp_params() - mtp_expert  # MTP modules sit after the last block
        expert += mtp_expert
    return {"dense": dense, "expert": expert, "moe_layers": moe, "dense_layers": dense_layers}


def estimate_memory(spec, workload: Workload, layout: Layout, stage_layers: list[int],
                    capacity: float, reserve: float = 0.0) -> MemoryEstimate:
    """Peak per-rank memory over the pipeline stages (ZeRO shards over dp_shard x cp; experts are
    split over ep x tp and sharded over dp_shard x cp / ep). ``reserve`` is runtime overhead."""
    lay, w = layout, workload
    m = microbatches(lay, w)
    n_shard = lay.dp_shard * lay.cp
    pb, gb, _ = PRECISIONS[w.precision]
    tokens = lay.microbatch * w.seq_len // lay.cp
    best = None
    p = len(stage_layers)
    middle = max(range(1, p - 1), default=0,  # the middle stage holding the most block-microbatches
                 key=lambda i: stage_layers[i] * inflight_microbatches(p, m, lay.pp_schedule, lay.pp_virtual_stages, stage=i))
    for s in sorted({0, middle, p - 1}):
        prm = stage_params(spec, stage_layers, s)
        dense_local = prm["dense"] / lay.tp
        expert_local = prm["expert"] / (lay.tp * lay.ep)
        bd = {}
        for part, count, shards in (("dense", dense_local, n_shard),
                                    ("expert", expert_local, max(1, n_shard // lay.ep))):
            per = estimate_state_bytes_per_param(lay.zero_stage, shards, w.precision)
            for k in ("params", "grads", "optimizer"):
                bd[k] = bd.get(k, 0.0) + count * per[k]
        n_layers = stage_layers[s]
        layer_local = (spec.layer_params(spec.is_moe) / lay.tp) if n_layers else 0
        if lay.zero_stage == 3:  # gathered current + prefetched block, one block's full grads
            bd["zero3_buffers"] = layer_local * (2 * pb + gb)
        if w.precision == "fp32" and w.act_bytes == 2:  # autocast's bf16 weight copies, kept for bwd
            bd["param_casts"] = 2 * (dense_local + expert_local) / (n_shard if lay.zero_stage == 3 else 1)
        act = _stage_activations(spec, w, lay, tokens, prm, n_layers)
        inflight = inflight_microbatches(lay.pp, m, lay.pp_schedule, lay.pp_virtual_stages, stage=s)
        bd["activations"] = act["stored"] * inflight + act["working"]
        if s == len(stage_layers) - 1:  # logits (bf16) + fp32 softmax of the cross entropy
            bd["logits"] = tokens * spec.vocab_size / lay.tp * (w.act_bytes + 4)
        bd["runtime_reserve"] = reserve
        est = MemoryEstimate(bd, sum(bd.values()), capacity, s)
        if best is None or est.total > best.total:
            best = est
    return best


def _stage_activations(spec, w: Workload, lay: Layout, tokens: int, prm: dict, n_layers: int) -> dict:
    """Bytes one microbatch leaves stored on a stage (``stored``) and the transient working set of
    recomputing one block (``working``), under the layout's checkpointing policy."""
    kw = {"tokens": tokens, "seq_len": w.seq_len, "tp": lay.tp, "sp": lay.seq_parallel, "flash": w.flash,
          "act_bytes": w.act_bytes}
    policy = "selective" if lay.ac == "selective" else "none"
    n_moe = prm["moe_layers"]
    per_dense = estimate_activation_bytes_per_layer(spec, moe=False, policy=policy, **kw)
    per_moe = estimate_activation_bytes_per_layer(spec, moe=True, policy=policy, **kw)
    full = (n_layers - n_moe) * per_dense["total"] + n_moe * per_moe["total"]
    biggest = max(per_dense["total"], per_moe["total"] if n_moe else 0.0)
    inp = per_dense["input"]
    if lay.ac in ("none", "selective") or n_layers == 0:
        return {"stored": full, "working": 0.0}
    if lay.ac == "full":
        return {"stored": n_layers * inp, "working": biggest}
    c = ac_every(lay.ac, spec.n_layers)
    n_ck = -(-n_layers // c)  # checkpointed blocks: every C-th one
    avg = full / n_layers
    return {"stored": n_ck * inp + (n_layers - n_ck) * avg, "working": biggest}


def recompute_fraction(ac: str, n_layers: int) -> float:
    """Share of the blocks whose forward is run again in backward (selective: 0, see timing)."""
    if ac == "full":
        return 1.0
    c = ac_every(ac, n_layers)
    return 1.0 / c if c else 0.0
