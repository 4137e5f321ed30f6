"""The trainer's memory accounting (``Workload.memory_model = "trainer"``): what ndtrain's own
modules keep per rank in eager PyTorch, the figures ``ndtrain rehearse`` measures, on every axis.

Model state per parameter (``trainer_state_bytes``), with master bytes m (4; 8 for float64) and
compute bytes c (2 under bf16, else m), N = ZeRO shards (``planner.eager``'s table, Rajbhandari et
al. 2020 with the trainer's dtypes):

    zero 0  m, m, 2m        (fp32 weights even for bf16 runs: autocast casts them per microbatch)
    zero 1  c, c, 3m/N      (compute-dtype weights and gradients; fp32 master + Adam m, v sharded)
    zero 2  c, m/N, 3m/N
    zero 3  m/N, m/N, 2m/N

Activations per block and token (``trainer_layer_bytes``): the tensors autograd saves in
``ndtrain.model`` (Korthikanti et al. 2022's method, op by op as in ``planner.eager``), on one TP
rank's shapes (heads, kv heads, SwiGLU hidden / t), s = microbatch x T / cp tokens. ``kind``:
``autocast`` (zero 0 bf16: fp32 residual stream, each linear casts its input to bf16 and its
weight once per microbatch), ``lowp`` (weights in the compute dtype e: bf16 under ZeRO, fp32,
float64). Per RMSNorm: the fp32 input copy 4h, rsqrt 4, the normalised y (e or 4 bytes); its output
w*y (or autocast's bf16 casts of it, one per linear) is what the projections save. With sequence
parallelism everything on the residual stream is divided by t; the gathered projection inputs are
not. Attention (SDPA's flash kernel) saves q, k, v, out and the fp32 logsumexp; SDPA takes the
math path when the query / key head width differs from the value's (MLA), which casts q, k, v up
to fp32 and keeps them and the fp32 softmax probabilities (T per head), and, while a block runs,
two more fp32 T x T tensors per head (``working``). SwiGLU keeps gate, SiLU(gate),
up and their product. MoE blocks: the router's fp32 scores (E), the routing's indices and
weights (32 bytes per routed copy), then per routed copy (top-k) the dispatched input, the
expert's four SwiGLU tensors and the combined output in the experts' dtype (no fp32 copy:
``model/moe_autograd.py``); shared experts as a dense SwiGLU. MLA: the latent norms' fp32 input
copies and outputs, the concatenated [q latent | kv latent | RoPE key] that wq_b and wkv_b read,
then the math core's fp32 q, k, v (``model/mla.py`` expands the latent before the core).
The other token mixers of ``model.layer_pattern`` (linear, mamba2, gated_deltanet, sliding_window,
dsa) replace the attention half with their own (``trainer_mixers``); a stage sums each block under
its mixer (``stage_mixer_counts``).
"""
from __future__ import annotations

from ndtrain.mixer_spec import layer_mixers, parse_pattern
from ndtrain.planner.pipeline import grad_share_at_peak
from ndtrain.planner.trainer_ac import POLICY_NAMES, math_core_bytes, policy_block_bytes
from ndtrain.planner.trainer_mixer_ac import mixer_policy_bytes
from ndtrain.planner.trainer_mixers import mixer_half_bytes, rope_casts
from ndtrain.planner.trainer_split import captured_output_bytes, split_pending_bytes, w_gradient_bytes

MEMORY_MODELS = ("fused", "trainer")


def trainer_kind(precision: str, act_bytes: int, zero_stage: int) -> tuple[str, int]:
    """(kind, compute bytes e) of the trainer for a planner workload (see the module docstring)."""
    if precision == "fp64" or act_bytes == 8:
        return "lowp", 8
    if act_bytes == 2:
        return ("lowp", 2) if zero_stage >= 1 else ("autocast", 2)
    return "lowp", 4


def trainer_state_bytes(precision: str, act_bytes: int, zero_stage: int, n_shards: int) -> dict:
    """Bytes per parameter (params, grads, optimizer) one rank holds; the module docstring's table.
    Raises ValueError for a zero_stage outside 0..3."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage ({zero_stage}) must be 0..3")
    m = 8 if (precision == "fp64" or act_bytes == 8) else 4
    c = 2 if act_bytes == 2 else m
    n = max(1, n_shards)
    rows = {0: (m, m, 2 * m), 1: (c, c, 3 * m / n), 2: (c, m / n, 3 * m / n), 3: (m / n, m / n, 2 * m / n)}
    p, g, k = rows[zero_stage]
    return {"params": p, "grads": g, "optimizer": k, "total": p + g + k}


def _local(spec, tp: int) -> dict:
    """One TP rank's widths: query / kv heads (kv replicated when tp > kv heads), hiddens."""
    return {"a": spec.n_heads / tp, "g": max(spec.n_kv_heads / tp, 1.0), "f": spec.ffn_hidden / tp,
            "fe": spec.moe_ffn_hidden / tp, "fs": spec.n_shared_experts * spec.shared_ffn_hidden / tp}


def _norm(h: float, kind: str, e: int, n_linears: int, ts: int) -> float:
    """Bytes per token one RMSNorm and its consumers' saved inputs hold: fp32 input copy, rsqrt and
    y on the (SP-sharded) residual stream; then the projections' saved input (autocast: one bf16
    cast per linear reading it). Under SP (``ts`` = tp) the projections save the sequence shard
    once, cast once, and all-gather it again in backward (``parallel/tp/sp_linear.py``)."""
    if kind == "autocast":
        return (4 * h + 4 + 4 * h) / ts + (2 * h / ts if ts > 1 else n_linears * 2 * h)
    return (4 * h + 4 + e * h) / ts + e * h / ts


def _attention(spec, loc: dict, kind: str, e: int, ts: int, seq_len: int) -> float:
    """Per-token bytes of the attention half: its norm, projections' inputs and the core's tensors."""
    h, D = spec.dim, spec.head_dim
    lse = 8 if e == 8 else 4
    if not spec.kv_lora_rank:
        q, k = loc["a"] * D, loc["g"] * D
        return _norm(h, kind, e, 3, ts) + e * (2 * q + 2 * k) + lse * loc["a"]
    qr, kr, r = spec.q_lora_rank, spec.kv_lora_rank, spec.qk_rope_head_dim
    dqk, dv = D + r, spec.v_head_dim or D
    out = _norm(h, kind, e, 2 if qr else 1, ts)
    if kind == "autocast":  # latents in the fp32 residual's dtype, norms as on the residual
        if qr:  # q latent and its norm (input of wq_b)
            out += 4 * qr + _norm(qr, kind, e, 1, 1)
        out += _norm(kr, kind, e, 1, 1) + 4 * r  # kv latent norm (input of wkv_b), RoPE key
    else:
        # each latent RMSNorm: fp32 input copy (fp32: the input itself, for c_kv the whole wkv_a
        # output it views), rsqrt, y; then wq_b / wkv_b keep their input, the concatenation
        # [q latent normalised | c_kv normalised | k_rope] that enters the heads (model/mla.py)
        if qr:
            out += 4 * qr + 4 + e * qr
        out += 4 * kr + 4 + e * kr + (4 * r if e == 4 else 0)
        out += e * ((qr or h) + kr + r)
    a = loc["a"]
    if dqk != dv:  # SDPA's math path: float32 q, k, v and softmax probabilities; out (input of wo)
        return out + math_core_bytes(a, dqk, dv, e, seq_len) + e * a * dv
    return out + e * a * (2 * dqk + 2 * dv) + lse * a  # q, k, v, out of the flash core


def _swiglu(h: float, f: float, kind: str, e: int, ts: int) -> float:
    return _norm(h, kind, e, 2, ts) + 4 * e * f


def _moe(spec, loc: dict, kind: str, e: int, ts: int) -> float:
    """Per-token bytes of a MoE MLP: norm (its output is the router's and the shared experts'
    saved input), the fp32 router scores (E; the logits are not kept), the routing's bookkeeping
    (int64 expert ids, sort order and source rows, fp32 gathered and final weights: 32 bytes per
    copy; two fp32 per-token sums), per routed copy (top-k) the dispatched input, the expert's
    SwiGLU tensors and the combined output in the experts' dtype (``model/moe_autograd.py``:
    neither the router nor the combine keeps a float32 copy; autocast: fp32, ``grouped_mm`` is
    not autocast), shared experts as a dense SwiGLU."""
    h, k = spec.dim, spec.top_k
    ex = 4 if kind == "autocast" else e
    out = _norm(h, "lowp" if kind != "autocast" else "autocast", e, 1, ts) + 4 * spec.n_experts + 32 * k + 8
    out += k * (ex * (4 * loc["fe"] + 2 * h))
    if loc["fs"]:
        out += 4 * e * loc["fs"] + (2 * 2 * h if kind == "autocast" else 0)
    return out


def trainer_layer_bytes(spec, tokens: int, seq_len: int, tp: int = 1, sp: bool = False, moe: bool = False,
                        kind: str = "lowp", e: int = 2, policy: str = "none", mixer: str = "attention",
                        chunk: int | None = None) -> dict:
    """Bytes one block keeps for backward on one rank for one microbatch of ``tokens`` tokens
    (``seq_len``: the key length); {"attention", "mlp", "weight_casts", "rope", "total", "working",
    "tokens"}. ``policy``: none or a per-layer checkpointing policy (``trainer_ac``). ``mixer``: the
    block's token mixer (``mixer_spec``); "attention" holds its half, ``trainer_mixers`` for the
    others (``chunk``: their linear_chunk_size, None: the spec's or the default). A mixer-only block
    (``ffn_hidden`` 0, not MoE) has no feed-forward half."""
    loc, ts, h = _local(spec, tp), (tp if sp else 1), spec.dim
    if mixer == "attention":
        attn = _attention(spec, loc, kind, e, ts, seq_len) * tokens
    else:
        attn = mixer_half_bytes(spec, mixer, tp, e, seq_len, tokens, lambda w, n: _norm(w, kind, e, n, ts), chunk)
    if moe and spec.is_moe:
        mlp = _moe(spec, loc, kind, e, ts) * tokens
    else:
        mlp = _swiglu(h, loc["f"], kind, e, ts) * tokens if spec.ffn_hidden else 0.0
    casts = 0.0
    if kind == "autocast":  # bf16 copies of the block's matrices, kept by the matmuls (per microbatch)
        dense = spec.layer_params(False) - 2 * h
        casts = 2 * dense / tp
    # cos / sin cast to the compute dtype at the positions, per block (fp32: no cast)
    # (per q / k pair rotated: ``rope_casts``)
    rope = 0 if (kind == "lowp" and e == 4) else rope_casts(mixer) * 4 * (spec.head_dim // 2) * e * seq_len
    total = attn + mlp + casts + rope
    # math SDPA's transient while one block runs: two fp32 T x T tensors per head (scores, softmax)
    dqk, dv = spec.head_dim + spec.qk_rope_head_dim, spec.v_head_dim or spec.head_dim
    mla_math = mixer == "attention" and spec.kv_lora_rank and dqk != dv
    working = 8 * loc["a"] * tokens * seq_len if mla_math else 0.0
    out = {"attention": attn, "mlp": mlp, "weight_casts": casts, "rope": rope, "total": total, "working": working,
           "tokens": tokens}
    if policy == "none":
        return out
    res = policy_block_bytes(out, spec, loc, kind, e, ts, seq_len, moe, policy,
                             lambda w, n, t: _norm(w, kind, e, n, t))
    if mixer != "attention":  # the policies' mixer terms are softmax attention's: this mixer's own
        res["attention"], res["rope"] = mixer_policy_bytes(spec, mixer, policy, attn, rope, tokens, seq_len, tp, e,
                                                           kind, ts, lambda w, n: _norm(w, kind, e, n, ts), chunk)
        res["total"] = res["attention"] + res["mlp"] + res["weight_casts"] + res["rope"]
    return res


def trainer_loss_bytes(spec, tokens: int, tp: int = 1, fused_loss: bool = False,
                       chunk_tokens: int = 1024, chunk_vocab: int = 8192) -> float:
    """Peak bytes of the output head + cross entropy for one microbatch on the last stage, per head
    pass (1 + MTP depth). Unfused (``tp/vocab_loss.py``, ``F.cross_entropy``): the bf16 logits, their
    fp32 copy, the shifted and the exponentiated logits (the softmax kept for backward): 14 bytes a
    logit. Fused (``ops/linear_cross_entropy``, Wijmans et al. 2024): three fp32 blocks of
    chunk_tokens x chunk_vocab logits and the fp32 head-weight gradient it accumulates."""
    v_local = -(-spec.vocab_size // tp)
    if fused_loss:
        block = 3 * 4 * min(chunk_tokens, tokens) * min(chunk_vocab, v_local)
        return block + 4 * v_local * spec.dim
    return 14.0 * tokens * v_local * (1 + spec.mtp_depth)


def trainer_rank_breakdown(spec, w, lay, prm: dict, n_layers: int, n_moe: int, head: bool,
                           inflight: float, n_micro: int, tokens: int, layers: tuple | None = None,
                           stage: int = 0, embedding: bool = False) -> dict:
    """One pp rank's bytes under the trainer's accounting: model state (``trainer_state_bytes``;
    dense parts sharded over dp_shard x cp, experts over dp_shard x cp / ep), the ``inflight``
    microbatches' blocks, one block's backward working set, the loss. Gradients count at the
    activation peak only when a backward finished before it (``n_micro`` > ``inflight``: the stage
    peaks again in the steady state; with as many microbatches as in flight it peaks at its first
    backward, before any gradient exists). ``prm``: ``memory.rank_params``' counts. ``layers``: the
    rank's block indices, so each block counts under its own token mixer (``stage_mixer_counts``).
    Under ``zero_bubble`` rank ``stage`` also holds what W needs (``trainer_split``), and its peak
    (a B or W) follows an earlier W, so gradients count whenever the step has two microbatches."""
    kind, e = trainer_kind(w.precision, w.act_bytes, lay.zero_stage)
    n_shard = lay.dp_shard * lay.cp
    bd = {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
    experts = prm["expert"] / (lay.etp * lay.ep)  # folded mesh: over ep x expert_tp
    for count, shards in ((prm["dense"] / lay.tp, n_shard), (experts, lay.expert_shards)):
        per = trainer_state_bytes(w.precision, w.act_bytes, lay.zero_stage, shards)
        for k in ("params", "grads", "optimizer"):
            bd[k] += count * per[k]
    split = lay.pp_schedule == "zero_bubble" and lay.pp > 1
    all_grads = bd["grads"]
    if not (split and n_micro > 1):  # at the activation peak: only the chunks whose backward began
        bd["grads"] *= grad_share_at_peak(lay.pp, n_micro, lay.pp_schedule, lay.pp_virtual_stages, stage)
    if split:  # W's gradients in the unsharded gradient's dtype (ZeRO 0: fp32, else the compute dtype)
        local = prm["dense"] / lay.tp + prm["expert"] / (lay.etp * lay.ep)
        grad_bytes = trainer_state_bytes(w.precision, w.act_bytes, min(lay.zero_stage, 1), 1)["grads"]
        bd["w_pending_grads"] = split_pending_bytes(spec, lay, tokens, e, kind == "autocast", n_layers, n_moe,
                                                    embedding, head, stage, n_micro, getattr(w, "fused_loss", False))
        bd["w_gradients"] = w_gradient_bytes(lay, local, grad_bytes)
    if lay.zero_stage == 3 and n_layers:  # gathered current + prefetched block, one block's grads
        bd["zero3_buffers"] = spec.rank_block_params(n_moe > 0, lay.tp, lay.ep, lay.etp) * (2 * e + 4)
    per_layer = lay.ac if lay.ac in POLICY_NAMES else "none"
    kw = {"tokens": tokens, "seq_len": w.seq_len, "tp": lay.tp, "sp": lay.seq_parallel, "kind": kind, "e": e,
          "policy": per_layer}
    dense_b = trainer_layer_bytes(spec, moe=False, **kw)
    dense, working = dense_b["total"], dense_b["working"] if n_layers else 0.0
    moe = trainer_layer_bytes(spec, moe=True, **kw)["total"] if spec.is_moe else dense
    per_mb = (n_layers - n_moe) * dense + n_moe * moe
    mixers = stage_mixer_counts(spec, n_layers, layers)
    # the mixer half and the feed-forward half add up, so each non-attention block swaps its
    # attention half for its own (MoE or dense alike); "whole" blocks take the largest mixer
    swaps = {k: trainer_layer_bytes(spec, moe=False, mixer=k, **kw)["total"] - dense for k in mixers if k != "attention"}
    per_mb += sum(mixers[k] * d for k, d in swaps.items())
    top = max([0.0] + [d for k, d in swaps.items()])  # the largest block's excess over attention
    bd["activations"] = _checkpointed(spec, lay, per_mb, n_layers, kind, e, tokens, w.seq_len) * inflight
    if split:
        logits = head and not getattr(w, "fused_loss", False)
        bd["captured_outputs"] = inflight * tokens * _captured(spec, lay, e, n_layers, n_moe, logits)
    if lay.ac not in ("none", "core_attn", "deepseek") and n_layers:  # one block recomputed in backward
        kw["policy"] = "none"  # what the recompute rebuilds: the block as under none
        whole = [trainer_layer_bytes(spec, moe=m, **kw)["total"] for m in {False, spec.is_moe}]
        whole = [b + max([0.0] + [trainer_layer_bytes(spec, moe=False, mixer=k, **kw)["total"] - whole[0]
                                  for k in swaps]) for b in whole]
        working += max(0.0, max(whole) - (max(dense, moe) + top if per_layer != "none" else 0.0))
    if working:
        bd["backward_working"] = working
    if head:
        bd["logits"] = trainer_loss_bytes(spec, tokens, lay.tp, getattr(w, "fused_loss", False))
        if working:  # the loss's buffers die before the first block's backward: only the larger counts
            bd["backward_working"] = max(0.0, working - bd["logits"])
    return _last_backward(bd, all_grads, working) if not split else bd


def _last_backward(bd: dict, all_grads: float, working: float) -> dict:
    """The larger of the activation peak ``bd`` and the step's last backward: every gradient,
    the state and one block's backward working set, the activations all but freed (seen where the
    activation peak precedes most backwards: interleaved with m = p, Llama 3 405B at 16,384 GPUs).
    ``working``: one block's backward working set (on a head stage not netted against the loss)."""
    last = {k: bd[k] for k in ("params", "optimizer", "zero3_buffers") if k in bd}
    last["grads"], last["backward_working"] = all_grads, working  # the loss's buffers long gone
    return last if sum(last.values()) > sum(bd.values()) else bd


def stage_mixer_counts(spec, n_layers: int, layers: tuple | None = None) -> dict:
    """{mixer: blocks} of a rank running ``n_layers`` blocks: by its block indices ``layers`` (the
    model's ``layer_pattern``; blocks past it, the MTP depths, are attention), or without them the
    rank's share of each mixer over the pattern's period (fractional counts)."""
    if not spec.mixers or not n_layers:
        return {"attention": n_layers}
    if layers is not None:
        kinds = layer_mixers(spec.mixers.layer_pattern, spec.n_layers)
        out: dict = {}
        for i in layers:
            k = kinds[i] if i < len(kinds) else "attention"
            out[k] = out.get(k, 0) + 1
        extra = n_layers - len(layers)  # MTP blocks (attention, ``model/block.py``)
        if extra > 0:
            out["attention"] = out.get("attention", 0) + extra
        return out
    period = parse_pattern(spec.mixers.layer_pattern)
    return {k: n_layers * period.count(k) / len(period) for k in set(period)}


def _captured(spec, lay, e: int, n_layers: int, n_moe: int, logits: bool) -> float:
    """Bytes per token of a graph's recorded owner outputs no backward saves under a split backward
    (``trainer_split.captured_output_bytes``), the head's logits with ``logits``."""
    blocks = sum(count * captured_output_bytes(spec, lay.tp, e, moe, lay.ep)
                 for moe, count in ((False, n_layers - n_moe), (True, n_moe)) if count)
    return blocks + (-(-spec.vocab_size // lay.tp) * e if logits else 0.0)


def _checkpointed(spec, lay, per_mb: float, n_layers: int, kind: str, e: int, tokens: int, seq_len: int) -> float:
    """A microbatch's stored bytes under the layout's checkpointing: ``full`` keeps each block's
    input (the residual stream, SP-sharded), ``every:C`` that for every C-th block and everything
    for the others; ``none`` and the part policies (``core_attn``, ``deepseek``: ``per_mb``
    already under them) all of it. Every policy that checkpoints whole blocks (full, every:C,
    sqrt, selective, op) also keeps the regions' other inputs once per model chunk of the rank
    (each chunk's forward indexes its own; ``parallel/activation_ckpt.py``): the RoPE tables at
    the positions, ``cos`` and ``sin``, each (T / cp, D_rope / 2) float32, not sharded by SP
    (D_rope: head_dim, or MLA's decoupled RoPE width)."""
    if lay.ac in ("none", "core_attn", "deepseek") or not n_layers:
        return per_mb
    rope_dim = spec.qk_rope_head_dim if spec.kv_lora_rank else spec.head_dim
    chunks = 1 if lay.pp <= 1 else (2 if lay.pp_schedule == "dualpipev" else max(1, lay.pp_virtual_stages))
    tables = 2 * 4 * (seq_len // lay.cp) * (rope_dim // 2) * min(chunks, n_layers)  # an embedding-only chunk: none
    if lay.ac in POLICY_NAMES:
        return per_mb + tables
    from ndtrain.planner.layout import ac_every

    inp = (4 if kind == "autocast" else e) * spec.dim * tokens / (lay.tp if lay.seq_parallel else 1)
    n_ck = n_layers if lay.ac == "full" else -(-n_layers // ac_every(lay.ac, spec.n_layers))
    return n_ck * inp + (n_layers - n_ck) * per_mb / n_layers + tables
