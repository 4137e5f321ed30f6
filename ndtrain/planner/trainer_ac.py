"""What one block keeps for backward under each per-layer checkpointing policy, in the trainer's
accounting (``trainer_memory``): the tensors ``ndtrain.parallel.activation_ckpt`` (``selective``,
``op``) and ``ac_recompute`` (``core_attn``, ``deepseek``) leave saved, per token on one TP rank.

* ``selective`` / ``op`` (selective activation checkpointing of the whole block): the block's
  input and the outputs of every ``mm`` / ``addmm`` / ``bmm`` (q, k, v; the O projection's and the
  down projection's outputs at full width h, since the row-parallel matmul runs before its
  reduce-scatter or all-reduce; gate and up; the router logits; the shared experts'); ``op`` also
  the fused attention kernel's output and log-sum-exp (torchtitan's op SAC). Math attention (MLA
  on this CPU) runs as two float32 ``bmm``: its scores and output are kept by both. Norms, RoPE, SiLU(g)*u,
  autocast's casts and the routed experts' ``grouped_mm`` are recomputed.
* ``core_attn``: ``none`` less the attention core's own state (log-sum-exp; the math kernel's
  float32 q, k, v and probabilities); q, k, v stay as the core's inputs (v as the kv projection
  output it views), its output as the O projection's.
* ``deepseek``: every RMSNorm keeps only its input; the projections that read a norm keep nothing
  for it (the output is recomputed), except autocast's bf16 casts of it; MLA keeps its latents and
  the attention output, not the per-head q, k, v.

Bytes per token: ``e`` the compute dtype, ``r`` the residual stream's (4 under autocast), widths
sharded by TP as in ``trainer_memory._local``; under SP the residual stream is 1/t of it.
"""
from __future__ import annotations

POLICY_NAMES = ("selective", "op", "core_attn", "deepseek")


def math_core_bytes(a: float, dqk: int, dv: int, e: int, seq_len: int) -> float:
    """Per-token bytes PyTorch's math SDPA keeps for backward (the path MLA takes where query / key
    and value widths differ): q, k, v cast up to float32 (float64 stays) and the softmax
    probabilities, ``seq_len`` per head; a heads (TP-local). Measured on bf16, fp32 blocks."""
    return max(e, 4) * a * (2 * dqk + dv + seq_len)


def norm_casts(h: float, kind: str, ts: int, n_linears: int) -> float:
    """Autocast's bf16 copies of a norm's output that its linears keep (SP: one shard cast)."""
    if kind != "autocast":
        return 0.0
    return 2 * h / ts if ts > 1 else n_linears * 2 * h


def _lse(e: int) -> int:
    return 8 if e == 8 else 4


def _mla_dims(spec) -> tuple[int, int, int, int, int]:
    d, r = spec.head_dim, spec.qk_rope_head_dim
    return d, d + r, spec.v_head_dim or d, spec.kv_lora_rank, r


def matmul_outputs(spec, loc: dict, e: int, seq_len: int, moe: bool, attn_kernel: bool) -> dict:
    """Per-token bytes of the mm / bmm outputs of one block (and the fused attention's outputs when
    ``attn_kernel``): what ``selective`` / ``op`` keep besides the block input."""
    h, a = spec.dim, loc["a"]
    if spec.kv_lora_rank:
        d, dqk, dv, kr, r = _mla_dims(spec)
        q = (spec.q_lora_rank + a * dqk) if spec.q_lora_rank else a * dqk
        attn = e * (q + kr + r + a * (d + dv))  # wq_a / wq_b, wkv_a, wkv_b outputs
        if dqk != dv:  # the math kernel: two bmm in float32, scores and output
            attn += max(e, 4) * a * (seq_len + dv)
        elif attn_kernel:
            attn += e * a * dv + _lse(e) * a
    else:
        d = spec.head_dim
        attn = e * (a * d + 2 * loc["g"] * d) + (e * a * d + _lse(e) * a if attn_kernel else 0.0)
    attn += e * h  # the O projection, before its reduction
    if moe and spec.is_moe:  # router logits; the routed experts' grouped_mm is recomputed
        mlp = e * spec.n_experts + (e * (2 * loc["fs"] + h) if loc["fs"] else 0.0)
    else:
        mlp = e * (2 * loc["f"] + h)
    return {"attention": attn, "mlp": mlp}


def policy_block_bytes(none: dict, spec, loc: dict, kind: str, e: int, ts: int, seq_len: int, moe: bool,
                       policy: str, norm_bytes) -> dict:
    """``none`` (``trainer_layer_bytes``' dict of one block, per microbatch) -> the same dict under
    ``policy``; ``norm_bytes(h, n_linears, ts)`` is ``trainer_memory._norm`` for this kind.
    Per-token terms are scaled by the block's tokens, read off ``none["tokens"]``. Raises
    ValueError for a policy outside ``POLICY_NAMES``."""
    tokens, h = none["tokens"], spec.dim
    r = 4 if kind == "autocast" else e
    attn, mlp = none["attention"], none["mlp"]
    if policy in ("selective", "op"):
        mm = matmul_outputs(spec, loc, e, seq_len, moe, attn_kernel=policy == "op")
        attn, mlp = (r * h / ts + mm["attention"]) * tokens, mm["mlp"] * tokens
        out = {"attention": attn, "mlp": mlp, "weight_casts": 0.0, "rope": 0.0}
    elif policy == "core_attn":
        a = loc["a"]
        drop = _lse(e) * a
        d, dqk, dv, _, _ = _mla_dims(spec)
        if spec.kv_lora_rank and dqk != dv:  # the region keeps its inputs q, k and v's kv storage
            drop = math_core_bytes(a, dqk, dv, e, seq_len) - e * a * (2 * dqk + d + dv)
        out = {"attention": attn - drop * tokens, "mlp": mlp}
    elif policy == "deepseek":
        keep = r * h / ts  # a norm's input
        attn = _deepseek_attention(spec, loc, kind, e, ts, none, norm_bytes, keep)
        n_mlp = 1 if (moe and spec.is_moe) else 2
        mlp = mlp - (norm_bytes(h, n_mlp, ts) - keep - norm_casts(h, kind, ts, n_mlp)) * tokens
        out = {"attention": attn, "mlp": mlp}
    else:
        raise ValueError(f"per-layer policy must be one of {', '.join(POLICY_NAMES)}, not {policy!r}")
    if not none["mlp"]:  # a mixer-only block (model.block_ffn false): no feed-forward half to keep
        out["mlp"] = 0.0
    res = {**none, **out}
    res["total"] = res["attention"] + res["mlp"] + res["weight_casts"] + res["rope"]
    return res


def _deepseek_attention(spec, loc, kind, e, ts, none, norm_bytes, keep) -> float:
    """The attention half under ``deepseek``: the norm keeps its input; MLA its latents and output."""
    tokens, h = none["tokens"], spec.dim
    if not spec.kv_lora_rank:
        return none["attention"] - (norm_bytes(h, 3, ts) - keep - norm_casts(h, kind, ts, 3)) * tokens
    _, _, dv, kr, rr = _mla_dims(spec)
    lat = e if kind == "lowp" else 4
    n_lin = 2 if spec.q_lora_rank else 1
    per = keep + norm_casts(h, kind, ts, n_lin) + lat * (spec.q_lora_rank + kr + rr) + e * loc["a"] * dv
    return per * tokens
