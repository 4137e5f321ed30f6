"""What ndtrain's trainer really holds per rank when it runs eager PyTorch (CPU, or GPU without
fused kernels): model-state bytes per ZeRO stage and activation bytes, tensor by tensor.

Model state (``estimate_trainer_state_bytes``): the peak of params + grads + optimizer state as
``ndtrain.mem_account.StateMemory`` samples it (after each microbatch's backward, after the
gradient sync, after the optimizer step, and inside the data-parallel hooks on metered steps).
Master dtype m (fp32, fp64 for float64 runs), compute dtype c (bf16 under autocast, else m); Psi
parameters in ``n_t`` tensors, S = sum_i ceil(d0_i / N) * prod(rest_i) the dim-0 padded shard
(``ndtrain.parallel.zero.flat_shard``); every AdamW ``step`` counter is a 4-byte tensor:

    DDP     params m*Psi   grads m*Psi                     optim 2m*Psi + 4 n_t (moments)
    ZeRO-1  params c*Psi   grads c*Psi (full, until sync)  optim 3m*S + 4 n_t (master, moments)
    ZeRO-2  params c*Psi   grads m*S + c*bucket (in hooks) optim 3m*S + 4 n_t
    ZeRO-3  params m*S     grads m*S                       optim 2m*S + 4 n_t

(Rajbhandari et al. 2020's P + G + K/N, P + (G + K)/N, (P + G + K)/N, with the trainer's dtypes:
ndtrain keeps fp32 weights for bf16 runs, so plain DDP is 16 bytes/param in both precisions.)

Activations (``estimate_eager_activation_peak``): the structure is Korthikanti et al. 2022
("Reducing Activation Recomputation in Large Transformer Models", section 4): bytes per layer =
sum over the tensors autograd keeps for backward. Eager PyTorch keeps what each op's derivative
formula needs, not what a fused kernel would: ``mul`` saves the *other* operand of each input that
requires grad, ``mm`` its input (and weight), ``pow`` / ``silu`` their input, ``rsqrt`` its result,
``_log_softmax`` its result, CPU flash SDPA q, k, v, out and the logsumexp; ``add``, ``cat``, views
and dtype casts save nothing. Per token and layer (h width, q = a*D, k = g*D, f SwiGLU hidden):

    float32   residual h1 and block out 2*4h; per RMSNorm y = x*rsqrt and w*y: 2*4h + 4; RoPE'd q, k
              4q + 4k, v 4k, attention out 4q, logsumexp 4a; SwiGLU w1 x, silu, w3 x, product 4*4f
              -> 24h + 8q + 8k + 16f + 4a + 8          (fused, bf16, Korthikanti-style: ~8h+4q+4k+6f)
    float64   RMSNorm runs in fp32: fp32 copy 4h, rsqrt 4, y cast back 8h, w*y 8h (the residual is
              then not saved) -> 40h + 16q + 16k + 32f + 8a + 8, plus fp64 copies of cos / sin
    bfloat16  residual fp32 2*4h; per norm fp32 y 4h + 4; bf16 casts of the 5 projection inputs
              5*2h; q, k, v, out 2 bytes, lse fp32; SwiGLU 4*2f -> 26h + 4q + 4k + 8f + 4a + 8, plus
              the bf16 weight casts of the layer (2 bytes/param, per microbatch) and cos / sin casts
    bf16 + ZeRO-1/2/3 (the model's weights are bf16): as float64 with 2-byte tensors, no weight casts

The measured quantity (``ActivationMeter``) is the peak of live activation storages during one
microbatch's forward + backward, so transients count too. The peak is the largest of: end of
forward (logits + log-softmax output), the log-softmax backward (3 V-wide tensors), the output
projection's backward (its V x h weight gradient exists before AccumulateGrad takes it), and the
top block's SwiGLU backward (with ``full`` checkpointing: after recomputing the top block; with tied
embeddings the head's V x h weight gradient is still waiting for the embedding's, as autograd runs
a leaf's AccumulateGrad once all its uses are differentiated), and the embedding's dense gradient.
"""
from __future__ import annotations

import math

EAGER_DTYPES = ("float32", "float64", "bfloat16")
EAGER_POLICIES = ("none", "full")


def param_shapes(spec) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of ``ndtrain.model.Transformer``'s distinct parameters, in registration order.

    Raises ValueError for MoE / MLA specs (not modelled here)."""
    if spec.is_moe or spec.kv_lora_rank:
        raise ValueError("the eager accounting covers dense GQA models (no MoE / MLA)")
    h, q, k, f, V = spec.dim, spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim, \
        spec.ffn_hidden, spec.vocab_size
    out = [("tok_embeddings.weight", (V, h))]
    for i in range(spec.n_layers):
        p = f"layers.{i}."
        out += [(p + "attention_norm.weight", (h,)), (p + "attention.wq.weight", (q, h)),
                (p + "attention.wk.weight", (k, h)), (p + "attention.wv.weight", (k, h)),
                (p + "attention.wo.weight", (h, q)), (p + "ffn_norm.weight", (h,)),
                (p + "feed_forward.w1.weight", (f, h)), (p + "feed_forward.w3.weight", (f, h)),
                (p + "feed_forward.w2.weight", (h, f))]
    out.append(("norm.weight", (h,)))
    if not spec.tie_embeddings:
        out.append(("output.weight", (V, h)))
    return out


def padded_shard_numel(shapes, n: int) -> int:
    """S = sum_i ceil(d0_i / n) * prod(rest_i): one rank's dim-0 padded flat shard (elements)."""
    return sum(-(-s[0] // n) * math.prod(s[1:]) for s in shapes)


def _buckets(shapes, bucket_size_bytes: int, esize: int) -> list[int]:
    """Element counts of ZeRO-1/2 buckets: reverse registration order, closed at >= the size."""
    out, cur, size = [], 0, 0
    for s in reversed(shapes):
        cur += math.prod(s)
        size += math.prod(s) * esize
        if size >= bucket_size_bytes:
            out.append(cur)
            cur, size = 0, 0
    return out + ([cur] if cur else [])


def _dtype_bytes(dtype: str) -> tuple[int, int]:
    """(master bytes m, compute bytes c) of ``training.dtype``."""
    if dtype not in EAGER_DTYPES + ("float16",):
        raise ValueError(f"dtype {dtype!r} not modelled; known: {', '.join(EAGER_DTYPES)}")
    m = 8 if dtype == "float64" else 4
    return m, (2 if dtype in ("bfloat16", "float16") else m)


def estimate_trainer_state_bytes(spec, zero_stage: int = 0, n_shards: int = 1, dtype: str = "float32",
                                 bucket_size_bytes: int = 25 * 2**20, hooks_sampled: bool = True,
                                 n_micro: int = 2) -> dict:
    """Peak bytes of params / grads / optim (and their peak sum, ``total``) on one rank.

    ``n_shards``: ZeRO shard count (dp_shard x cp); ``hooks_sampled``: the step was metered
    (``Trainer.measure_memory``), so ZeRO-2's in-hook samples with a full bucket count.
    Raises ValueError for an unknown dtype, a zero_stage outside 0..3 or MoE / MLA specs.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage ({zero_stage}) must be 0..3")
    m, c = _dtype_bytes(dtype)
    shapes = [s for _, s in param_shapes(spec)]
    psi, n_t = sum(math.prod(s) for s in shapes), len(shapes)
    n = max(1, n_shards) if zero_stage else 1
    S = padded_shard_numel(shapes, n)
    steps = 4 * n_t
    if zero_stage == 0:
        out = {"params": m * psi, "grads": m * psi, "optim": 2 * m * psi + steps}
    elif zero_stage == 1:
        out = {"params": c * psi, "grads": c * psi, "optim": 3 * m * S + steps}
    elif zero_stage == 2:
        bucket = max(_buckets(shapes, bucket_size_bytes, m)) if hooks_sampled else 0
        acc = m * S if (n_micro >= 2 or not hooks_sampled) else 0
        out = {"params": c * psi, "grads": max(c * bucket + acc, m * S), "optim": 3 * m * S + steps}
    else:
        out = {"params": m * S, "grads": m * S, "optim": 2 * m * S + steps}
    out["total"] = out["params"] + out["grads"] + out["optim"]
    return out


def eager_mode(dtype: str, zero_stage: int = 0) -> tuple[str, int]:
    """(kind, compute bytes e): "fp32" (fp32 weights and compute), "autocast" (fp32 weights, bf16
    autocast: plain DDP), "lowp" (weights held in the compute dtype: float64 runs, and bf16 runs under
    ZeRO-1/2/3, whose model parameters are bf16). Raises ValueError for an unknown dtype."""
    if dtype == "float32":
        return "fp32", 4
    if dtype == "float64":
        return "lowp", 8
    if dtype in ("bfloat16", "float16"):
        return ("lowp", 2) if zero_stage >= 1 else ("autocast", 2)
    raise ValueError(f"dtype {dtype!r} not modelled; known: {', '.join(EAGER_DTYPES)}")


def eager_layer_bytes(spec, dtype: str = "float32", zero_stage: int = 0) -> dict:
    """Bytes one block keeps for backward in eager PyTorch: ``per_token`` (times the microbatch's
    tokens), ``per_microbatch`` (bf16 weight casts under autocast), ``per_seq_pos`` (times T: the
    casts of cos / sin), ``residual_out`` (per token: the block output, kept by the next RMSNorm
    only when the residual stream is fp32), ``mlp_per_token`` (the part of ``per_token`` from the
    MLP half: its norm, SwiGLU tensors and output). See the module docstring for the derivation."""
    kind, e = eager_mode(dtype, zero_stage)
    h, a, D = spec.dim, spec.n_heads, spec.head_dim
    q, k, f = a * D, spec.n_kv_heads * D, spec.ffn_hidden
    if kind == "fp32":
        tok = 24 * h + 8 * q + 8 * k + 16 * f + 4 * a + 8
        return {"per_token": tok, "per_microbatch": 0, "per_seq_pos": 0, "residual_out": 4 * h,
                "mlp_per_token": 16 * f + 12 * h + 4}
    if kind == "lowp":  # norm: fp32 copy + rsqrt + y cast back + w*y; lse fp32 (fp64 for fp64)
        lse = 8 if e == 8 else 4
        tok = 2 * (4 * h + 4 + 2 * e * h) + 2 * e * (q + k) + lse * a + 4 * e * f
        return {"per_token": tok, "per_microbatch": 0, "per_seq_pos": 4 * (D // 2) * e, "residual_out": 0,
                "mlp_per_token": 4 * e * f + 4 * h + 4 + 2 * e * h}
    tok = 26 * h + 4 * q + 4 * k + 8 * f + 4 * a + 8
    w = 2 * (h * q + 2 * h * k + q * h + 3 * h * f)  # bf16 weight casts kept by the mm nodes
    return {"per_token": tok, "per_microbatch": w, "per_seq_pos": 4 * (D // 2) * 2, "residual_out": 4 * h,
            "mlp_per_token": 8 * f + 12 * h + 4}


def estimate_eager_activation_peak(spec, microbatch: int, seq_len: int, dtype: str = "float32",
                                   policy: str = "none", zero_stage: int = 0) -> dict:
    """Peak live activation bytes of one microbatch's forward + backward (what
    ``ndtrain.mem_account.ActivationMeter`` measures) for a world-size-1 / DP / ZeRO / HSDP layout
    (``zero_stage`` matters for bf16: ZeRO keeps bf16 weights, so autocast casts nothing).

    Returns {"peak", "at" (which candidate), "candidates", "saved" (bytes kept at the end of
    forward, before the loss)}. Raises ValueError for a policy other than none / full or an
    unknown dtype.
    """
    if policy not in EAGER_POLICIES:
        raise ValueError(f"eager activation model covers ac in {EAGER_POLICIES}, not {policy!r}")
    kind, e = eager_mode(dtype, zero_stage)
    h, V, L, f, D = spec.dim, spec.vocab_size, spec.n_layers, spec.ffn_hidden, spec.head_dim
    s, T = microbatch * seq_len, seq_len
    lay = eager_layer_bytes(spec, dtype, zero_stage)
    layer = lay["per_token"] * s + lay["per_microbatch"] + lay["per_seq_pos"] * T
    el = 8 if e == 8 else 4  # the loss runs in the parameter dtype (fp32 for bf16 runs)
    ew = 4 if kind == "autocast" else e  # bytes of a weight gradient as AccumulateGrad gets it
    res = 4 if kind != "lowp" else e  # residual stream (a block's input)
    rope = 2 * T * (D // 2) * 4  # cos / sin gathered at the positions (fp32)
    last_out = lay["residual_out"] * s  # the last block's output, kept by the final norm (fp32)
    if kind == "fp32":
        head, emb = (8 * h + 4) * s, 4 * h * s  # final norm y, w*y, rsqrt; embedding out (block 0 in)
    elif kind == "lowp":
        head, emb = (4 * h + 4 + 2 * e * h) * s, 0
    else:  # fp32 y + rsqrt, bf16 cast of the head input, bf16 copy of the output weight
        head, emb = (6 * h + 4) * s + 2 * V * h, 4 * h * s
    if policy == "none":
        saved = L * layer + emb + rope + head
        top = saved - head - last_out  # before the top block's MLP backward: head freed
    else:  # block inputs only; the top block is recomputed (its output is not kept)
        inputs = L * res * h * s
        saved = inputs + rope + head + last_out
        top = inputs + rope + layer - last_out
    if spec.tie_embeddings:  # the head's gradient of the tied weight waits in autograd's input
        top += ew * V * h  # buffer until the embedding's backward (the leaf's last use) is done
    cand = {"forward_loss": saved + 2 * el * V * s, "log_softmax_backward": saved + 3 * el * V * s,
            "output_backward": saved + e * V * s + e * h * s + e * V * h}
    if e != el:  # the fp32 logits' gradient cast back to bf16
        cand["logits_cast_backward"] = saved + (el + e) * V * s
    if kind == "autocast":
        cand["output_weight_cast"] = saved + 2 * h * s + 4 * V * h
        # fp32 residual grad (+ its bf16 cast until w2's backward); the w2 node, the cast of its
        # weight gradient back to fp32, then the SwiGLU product's backward (w2's bf16 weight copy
        # and the product freed)
        cand["top_mlp_backward"] = top + max(6 * h * s + 2 * f * s + 2 * f * h, 4 * h * s + 4 * f * h,
                                             4 * h * s + 4 * f * s - 2 * f * h)
    else:  # the w2 node (grad of the product + weight grad), then the product's backward
        cand["top_mlp_backward"] = top + e * h * s + max(e * f * s + e * f * h, 2 * e * f * s)
    # the embedding's dense V x h gradient (tied: plus the head's, and their sum)
    cand["embedding_backward"] = rope + (3 if spec.tie_embeddings else 1) * ew * V * h
    at = max(cand, key=cand.get)
    return {"peak": cand[at], "at": at, "candidates": cand, "saved": saved}
