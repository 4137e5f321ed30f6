"""What the half of a block whose token mixer is not softmax attention keeps under each per-layer
checkpointing policy (``trainer_ac.POLICY_NAMES``), in the trainer's accounting: its ``none``
figures (``trainer_mixers``) turned into what ``parallel/activation_ckpt.py`` (``selective``, ``op``)
and ``parallel/ac_recompute.py`` (``core_attn``, ``deepseek``) leave saved, per token on one TP
rank's heads. The trainer accepts every policy with every mixer (no rule ties the two).

Notation as ``trainer_mixers``: e the compute dtype's bytes, f = max(e, 4), T the sequence, C
tokens per chunk, N chunks, p = N C / T; r the residual stream's bytes (4 under autocast, else e),
h the model width, ts = t under sequence parallelism (else 1).

* ``selective`` / ``op``: the block runs in a selective-checkpoint region that keeps its input
  (r h / ts) and the output of every mm / addmm / bmm it runs, whether or not backward reads it;
  everything else is recomputed (norms, convolution, gates, casts, masks, the triangular solve,
  the head scalars and the RoPE casts: the ``none`` figure's per-block bytes and ``rope`` go).
  Kept: the projections' outputs (the out projection at full width h, before its reduction) and,
  in the chunked kernels, each matmul's output for all N chunks (the first chunk's product with
  the zero state and the last chunk's state update too) in the matmul's dtype, e (bf16 under
  autocast). ``op`` also keeps the fused attention kernel's output and log-sum-exp, which only
  the sliding window calls.
* ``core_attn``: only a forward that calls its mixer's ``core`` changes, i.e. the sliding window:
  its core (padding, key blocks, mask, kernel) runs under a checkpoint, which keeps its inputs q,
  k and v, and wo keeps the kernel's output. The linear mixers have no ``core``; DSA's forward
  never calls it: both keep what they keep under ``none``.
* ``deepseek``: each RMSNorm runs under a checkpoint keeping its inputs, and a saved tensor that
  is a view of a norm's output is recomputed: the block norm keeps its input r h / ts (and
  autocast's bf16 casts); the gated output norms (Gated DeltaNet, Mamba-2) keep their two inputs
  in place of their internals.

Figures: the rehearsal's, to the byte, for every mixer under every policy (bf16 ZeRO-1,
``tests/rehearsal/test_mixer_accounting.py``; also at tp2 + SP), and an eager count of live
storages for fp32, one local key head or Mamba-2 group, and T not a multiple of C or w (there the
``none`` figures of the chunked mixers are approximate, and ``deepseek`` / ``core_attn`` differ from
the truth by what ``none`` does; ``selective`` / ``op`` are exact).
"""
from __future__ import annotations

import math

from ndtrain.mixer_spec import linear_dims
from ndtrain.planner.trainer_ac import POLICY_NAMES, norm_casts
from ndtrain.planner.trainer_mixers import (
    MIXER_HALVES,
    NORM_LINEARS,
    _chunks,
    gdn_gated_norm_bytes,
    gdn_z_is_view,
    mamba2_gated_norm_bytes,
    resolve_chunk,
    sliding_window_bytes,
)


def _lse(e: int) -> int:
    return 8 if e == 8 else 4


def chunked_matmul_bytes(spec, mixer: str, tp: int, e: int, seq_len: int, chunk: int) -> float:
    """Per-token bytes of the matmul outputs of a chunked kernel (the padded tokens included, p),
    each (B, H, N, C, *) in the matmul's dtype e. Local heads as ``trainer_mixers``.

    linear (a = H / t heads of dim D, v = [v | 1]): Q K^T a C; per chunk Q e^g S and the masked
      (Q K^T * D) v, 2 a (D + 1); the state update K^T v, a D (D + 1) / C.
    mamba2 (nh heads of P, state N_s, di = nh P): C B^T nh C; per chunk 2 di (state and intra
      products); the state update nh N_s P / C.
    gated_deltanet (hv value heads, K, V, val = hv V): (b K) K^T and Q K^T 2 hv C; per chunk W S,
      q e^g S and (Q K^T * D) U 3 val; the state update hv K V / C."""
    c, _, p = _chunks(seq_len, chunk)
    x = linear_dims(spec.mixers)
    if mixer == "linear":
        a, d = spec.n_heads / tp, spec.head_dim
        per = a * c + 2 * a * (d + 1) + a * d * (d + 1) / c
    elif mixer == "mamba2":
        nh, hp, ns = x["m_heads"] / tp, x["m_head_dim"], x["m_state"]
        per = nh * c + 2 * nh * hp + nh * ns * hp / c
    elif mixer == "gated_deltanet":
        hv, dk, dv = x["v_heads"] / tp, x["k_dim"], x["v_dim"]
        per = 2 * hv * c + 3 * hv * dv + hv * dk * dv / c
    else:
        raise ValueError(f"{mixer!r} runs no chunked kernel")
    return p * e * per


def sac_half_bytes(spec, mixer: str, tp: int, e: int, seq_len: int, chunk: int, op: bool) -> float:
    """Per-token bytes a ``selective`` (``op``: ``op``) region keeps of a ``mixer`` half besides the
    block input: its mm / bmm outputs (module docstring), h the width, local heads.

    linear: wq, wk, wv 3 e a D, wo e h; the chunked kernel's (``chunked_matmul_bytes``).
    mamba2: in_proj e (2 di + 2 gn + nh) (gn: the local groups' B / C width), out_proj e h; kernel.
    gated_deltanet: in_proj_qkvz e (2 key + 2 val), in_proj_ba 2 e hv, out_proj e h; kernel.
    sliding_window: wq, wk, wv e (a + 2g) D, wo e h; ``op``: the kernel's output and log-sum-exp
      on the padded query blocks, p (e a D + 4 a), p = ceil(T / w) w / T.
    dsa: wq, wk, wv e (a + 2g) D, wo e h; the indexer's projections e (H_I D + D + H_I) (whole on
      every rank) and its two einsums' bmm, the per-head scores e H_I T and their weighted sum e T;
      the attention's two einsums over the k = min(top_k, T) gathered keys, e a k and e a D. DSA
      calls no fused kernel, so ``op`` keeps what ``selective`` does."""
    h, a, g, d = spec.dim, spec.n_heads / tp, max(spec.n_kv_heads / tp, 1.0), spec.head_dim
    x = linear_dims(spec.mixers)
    if mixer == "linear":
        return 3 * e * a * d + e * h + chunked_matmul_bytes(spec, mixer, tp, e, seq_len, chunk)
    if mixer == "mamba2":
        nh, di = x["m_heads"] / tp, x["d_inner"] / tp
        gn = max(x["m_groups"] / tp, 1.0) * x["m_state"]
        return e * (2 * di + 2 * gn + nh) + e * h + chunked_matmul_bytes(spec, mixer, tp, e, seq_len, chunk)
    if mixer == "gated_deltanet":
        key, val, hv = x["k_heads"] / tp * x["k_dim"], x["v_heads"] / tp * x["v_dim"], x["v_heads"] / tp
        proj = e * (2 * key + 2 * val) + 2 * e * hv + e * h
        return proj + chunked_matmul_bytes(spec, mixer, tp, e, seq_len, chunk)
    proj = e * (a + 2 * g) * d + e * h
    if mixer == "sliding_window":
        w = min(spec.mixers.swa_window, seq_len)
        p = math.ceil(seq_len / w) * w / seq_len
        return proj + (p * (e * a * d + _lse(e) * a) if op else 0.0)
    if mixer == "dsa":
        hi, k = spec.mixers.dsa_index_heads, min(spec.mixers.dsa_top_k, seq_len)
        return proj + e * (hi * d + d + hi) + e * hi * seq_len + e * seq_len + e * a * k + e * a * d
    raise ValueError(f"no trainer accounting for mixer {mixer!r} (accounted: {', '.join(MIXER_HALVES)})")


def window_core_drop(spec, tp: int, e: int, seq_len: int) -> float:
    """Per-token bytes ``core_attn`` takes off a sliding-window half: its ``none`` core (padded query
    blocks, doubled key / value blocks, the additive mask, the log-sum-exp, the output and wo's
    input; ``trainer_mixers.sliding_window_bytes``) less what stays: the checkpoint's inputs, the
    rotated q e a D and k e g D and v (a view of wv's output) e g D, and wo's input e a D (the
    kernel's output when w divides T, whose padding is then nil; else wo's own copy)."""
    a, g, d = spec.n_heads / tp, max(spec.n_kv_heads / tp, 1.0), spec.head_dim
    core, _ = sliding_window_bytes(spec, tp, e, seq_len, lambda width, n: 0.0)  # the core alone
    return core - (2 * e * a * d + 2 * e * g * d)


def deepseek_drop(spec, mixer: str, tp: int, e: int, seq_len: int, chunk: int, kind: str, ts: int,
                  norm) -> float:
    """Per-token bytes ``deepseek`` takes off a ``mixer`` half (``norm(h, n_linears)``:
    ``trainer_memory._norm`` for this kind and SP). The block norm: its ``none`` bytes less its
    input r h / ts and autocast's casts (which are not views of its output).

    gated_deltanet: the gated norm's ``none`` bytes (``trainer_mixers.gdn_gated_norm_bytes``) less
      what stays: o, the kernel's output (bf16: the padded chunk stack p e val, of which o is a
      slice, in place of the fp32 copy; fp32: the o those bytes hold already), z (e val; a view of
      the whole in_proj_qkvz output e (2 key + 2 val) when ``gdn_z_is_view``), and out_proj's
      input e val: the norm's output keeps o's transposed layout, so the reshape before out_proj
      copies it rather than viewing the norm's output.
    mamba2: the gated norm's ``none`` bytes (``trainer_mixers.mamba2_gated_norm_bytes``) less what
      stays: y e di and z, a view of the whole in_proj output e (2 di + 2 gn + nh); out_proj reads
      a view of the norm's output (dropped).
    linear, sliding_window, dsa: no other norm (the indexer's projections read the block norm's
      output as a detached view, recomputed too)."""
    h, n_lin = spec.dim, NORM_LINEARS[mixer]
    r = 4 if kind == "autocast" else e
    drop = norm(h, n_lin) - r * h / ts - norm_casts(h, kind, ts, n_lin)
    x = linear_dims(spec.mixers)
    if mixer == "gated_deltanet":
        hk, hv = x["k_heads"] / tp, x["v_heads"] / tp
        key, val = hk * x["k_dim"], hv * x["v_dim"]
        _, _, p = _chunks(seq_len, chunk)
        z = e * (2 * key + 2 * val) if gdn_z_is_view(hk, hv) else e * val
        f = max(e, 4)
        o = p * e * val if e < f else f * val  # fp32: the o the gated norm's none bytes hold
        drop += gdn_gated_norm_bytes(e, key, val, hk, hv) - (o + z + e * val)
    elif mixer == "mamba2":
        nh, di = x["m_heads"] / tp, x["d_inner"] / tp
        groups = max(x["m_groups"] / tp, 1.0)
        ch = di + 2 * groups * x["m_state"]
        drop += mamba2_gated_norm_bytes(e, di, ch, nh, groups) - (e * di + e * (di + ch + nh))
    return drop


def mixer_policy_bytes(spec, mixer: str, policy: str, half: float, rope: float, tokens: int, seq_len: int,
                       tp: int, e: int, kind: str, ts: int, norm, chunk: int | None = None) -> tuple[float, float]:
    """(half, rope): the bytes one block's ``mixer`` half and its RoPE casts keep for one microbatch
    of ``tokens`` tokens under ``policy``, from their ``none`` figures ``half``
    (``trainer_mixers.mixer_half_bytes``) and ``rope``. ``norm(h, n_linears)``: ``trainer_memory._norm``
    for this kind and SP; ``chunk``: linear_chunk_size (None: the spec's or the default). Raises
    ValueError for a policy outside ``POLICY_NAMES`` or a mixer not in ``MIXER_HALVES``."""
    if mixer not in MIXER_HALVES:
        raise ValueError(f"no trainer accounting for mixer {mixer!r} (accounted: {', '.join(MIXER_HALVES)})")
    chunk = resolve_chunk(spec, chunk)
    if policy in ("selective", "op"):
        r = 4 if kind == "autocast" else e
        kept = r * spec.dim / ts + sac_half_bytes(spec, mixer, tp, e, seq_len, chunk, policy == "op")
        return kept * tokens, 0.0
    if policy == "core_attn":
        drop = window_core_drop(spec, tp, e, seq_len) if mixer == "sliding_window" else 0.0
        return half - drop * tokens, rope
    if policy == "deepseek":
        return half - deepseek_drop(spec, mixer, tp, e, seq_len, chunk, kind, ts, norm) * tokens, rope
    raise ValueError(f"per-layer policy must be one of {', '.join(POLICY_NAMES)}, not {policy!r}")
