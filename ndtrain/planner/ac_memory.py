"""What each per-layer activation-checkpointing policy keeps and recomputes, for the planner.

The segment policies (``full``, ``every:C``, ``sqrt``) are handled by ``planner.memory``'s stage
model; this module turns the ``none`` bytes of one layer (``memory.estimate_activation_bytes_per_layer``
with policy "none", the fused-kernel table) into the bytes each per-layer policy keeps, following
``ndtrain.parallel.activation_ckpt`` / ``ac_recompute``:

* ``selective`` - the planner's Korthikanti rule (``memory``: attention core and SiLU(g)*u dropped).
* ``op``        - matmul and fused-attention outputs kept, everything else recomputed: per token the
  block input (h r), q / k / v (the QKV matmul outputs), the attention output and log-sum-exp, the
  O projection output (h r), gate and up outputs (2 f / t, per routed copy f_e / t) and the down
  projection output (h r); norm outputs, RoPE and SiLU(g)*u are not kept.
* ``core_attn`` - Megatron's core-attention recompute: ``none`` less the softmax scores (no fused
  kernel) or the log-sum-exp (fused); the attention output stays as the O projection's input.
* ``deepseek``  - ``none`` less each block norm's output (the 2 h r "QKV in" and "gate/up in"
  terms, one per norm); for MLA also less the per-head q, k, v and log-sum-exp, plus the latents
  (d_q + d_c + d_r per token).

Bytes: ``e`` = bytes per activation element, ``tokens`` the microbatch tokens on this rank.
"""
from __future__ import annotations

PER_LAYER_POLICIES = ("none", "selective", "op", "core_attn", "deepseek")  # no block-input stage model


def policy_layer_bytes(none: dict, spec, tokens: int, seq_len: int, tp: int, sp: bool, moe: bool, flash: bool,
                       e: int, policy: str) -> dict:
    """``none`` ({"attention", "mlp", "input", "total"} of one layer under no checkpointing) -> the
    same dict for ``policy`` (one of ``PER_LAYER_POLICIES`` but ``selective``, which ``memory``
    computes itself). Raises ValueError for another policy."""
    if policy == "none":
        return dict(none)
    h, a, g, D = spec.dim, spec.n_heads, spec.n_kv_heads, spec.head_dim
    r = 1.0 / tp if sp else 1.0
    kv_local = max(g / tp, 1.0)
    dv = spec.v_head_dim or D
    rope = getattr(spec, "qk_rope_head_dim", 0) if getattr(spec, "kv_lora_rank", 0) else 0
    qkv = e * tokens * (a * (D + rope) / tp + kv_local * (D + rope + dv))  # per-head q, k, v
    lse = 4 * tokens * a / tp if flash else 0.0
    scores = 0.0 if flash else e * a * tokens * seq_len / tp
    attn, mlp = none["attention"], none["mlp"]
    if policy == "op":
        attn = e * tokens * h * r * 2 + qkv + e * tokens * a * dv / tp + lse  # input, q k v, out, O-proj out
        if moe and spec.is_moe:
            f = spec.n_shared_experts * spec.shared_ffn_hidden + spec.top_k * spec.moe_ffn_hidden
        else:
            f = spec.ffn_hidden
        mlp = e * tokens * (2 * f / tp + h * r)  # gate, up and down outputs
    elif policy == "core_attn":
        attn -= lse + scores
    elif policy == "deepseek":
        attn -= e * tokens * h * r * 2
        mlp -= e * tokens * h * r * 2
        if getattr(spec, "kv_lora_rank", 0):  # MLA: latents kept instead of the per-head q, k, v
            attn += e * tokens * (spec.q_lora_rank + spec.kv_lora_rank + rope) - qkv - lse - scores
    else:
        raise ValueError(f"per-layer policy must be one of {', '.join(PER_LAYER_POLICIES)}, not {policy!r}")
    return {"attention": attn, "mlp": mlp, "input": none["input"], "total": attn + mlp}


def recompute_attention_share(policy: str, spec) -> float:
    """Share of the attention forward (``ops.attn_fwd``) a per-layer policy runs again in backward:
    1 for ``selective`` and ``core_attn``, 1 for ``deepseek`` on MLA (the core is recomputed with
    the up-projections; their matmuls are small and not costed), else 0 (``op`` keeps it)."""
    if policy in ("selective", "core_attn"):
        return 1.0
    if policy == "deepseek" and getattr(spec, "kv_lora_rank", 0):
        return 1.0
    return 0.0
