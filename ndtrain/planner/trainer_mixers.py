"""The trainer's saved bytes of a block's token-mixer half for the mixers other than softmax attention
(``model.layer_pattern``; softmax attention is ``trainer_memory._attention``): the norm, the
projections' saved inputs and what the mixer's eager forward keeps for backward, read off
``ndtrain.model`` and the chunked kernels the trainer runs by default (``LINEAR_IMPL`` "chunk":
``ops/linear_attn/chunk.py``, ``ops/gated_delta/chunk.py``; the naive twins keep O(T) per-token
graphs and are not accounted), per token on one TP rank's heads (tp splits heads, SP shards only
the norm, as for attention).

Notation: e the compute dtype's bytes (2 bf16, 4 fp32), f = max(e, 4) the chunk kernels' dtype (a
bf16 input is cast to fp32 once, ``compute_dtype``; an fp32 input is used as is, so the casts that
a bf16 run keeps become views of tensors already held), m = 2 the bf16 copies autocast makes: a
bf16 run trains under ``torch.autocast`` (``Trainer.autocast``, ZeRO or not), so each matmul inside
a chunked kernel casts its fp32 operands to bf16 and keeps those copies (per chunk: the state
twice, the chunk's slices; autocast caches only leaf weights' casts), T the microbatch's sequence,
C = min(chunk, T) tokens per chunk, N = ceil(T / C) chunks, p = N C / T the padding factor of chunk
tensors, W the short-convolution width, late = (N - 1) / N: per-chunk tensors of all chunks but
the first (whose zero state needs no gradient) or but the last (its state update feeds only the
final state, which the mixer drops, so what it saved is freed). Each chunked core keeps the decay
matrix D and Q K^T-sized C-wide matrices, q, k, v in fp32 chunks, the states entering the chunks
(K x V per head, N per sequence: K V / C per token) and per-chunk slices of q e^g and
K e^(g_C - g). Every mixer also keeps up to two C x C bool masks and its head scalars, a few KiB
per block (``fixed``). Figures: live storages after the forward, matched exactly against a
storage count of ``saved_tensors_hooks`` on the eager modules (bf16 under autocast and fp32).
"""
from __future__ import annotations

import math

from ndtrain.mixer_spec import linear_dims

MIXER_HALVES = ("linear", "mamba2", "gated_deltanet", "sliding_window", "dsa")  # accounted here
DEFAULT_CHUNK = 64  # ModelConfig.linear_chunk_size's default, for a spec without MixerFields
# the projections reading each mixer's block norm (``norm``'s n_linears: autocast casts per linear)
NORM_LINEARS = {"linear": 3, "mamba2": 1, "gated_deltanet": 2, "sliding_window": 3, "dsa": 3}


def _chunks(seq_len: int, chunk: int) -> tuple[int, int, float]:
    """(C, N, p): tokens per chunk, chunks per sequence, padded over real tokens (>= 1)."""
    c = min(chunk, max(seq_len, 1))
    n = -(-seq_len // c)
    return c, n, n * c / seq_len


def resolve_chunk(spec, chunk: int | None) -> int:
    """linear_chunk_size: ``chunk``, else the spec's, else ``DEFAULT_CHUNK``."""
    return getattr(spec.mixers, "linear_chunk_size", DEFAULT_CHUNK) if chunk is None else chunk


def gdn_z_is_view(hk: float, hv: float) -> bool:
    """Whether Gated DeltaNet's z (B, T, H_v, V) is a view of the in_proj_qkvz output: its reshape
    out of the grouped layout (B, T, H_k, 2K + 2rV) merges H_k with r = H_v / H_k, which only a
    single local key head or r = 1 allows without a copy."""
    return hk <= 1 or hv <= hk


def gdn_gated_norm_bytes(e: int, key: float, val: float, hk: float, hv: float) -> float:
    """Per-token bytes the gated output norm RMSNorm(o) SiLU(z) of a Gated DeltaNet half keeps,
    out_proj's input included (``gated_deltanet_bytes``' projections; f = max(e, 4)): fp32 o (fp32
    runs: the kernel's output itself), the normalised y, w y in fp32, SiLU(z) 3 f val; z in fp32
    f val (fp32 runs: z itself, a copy of the split projection, or a view keeping the whole
    in_proj_qkvz output e (2 key + 2 val), see ``gdn_z_is_view``); the rsqrt f hv; y and out_proj's
    input 2 e val."""
    f = max(e, 4)
    z = f * val if e < f else (e * (2 * key + 2 * val) if gdn_z_is_view(hk, hv) else e * val)
    return (3 * f + 2 * e) * val + z + f * hv


def mamba2_gated_norm_bytes(e: int, di: float, ch: float, nh: float, groups: float) -> float:
    """Per-token bytes the gated norm RMSNorm(y SiLU(z)) of a Mamba-2 half keeps, out_proj's input
    included (``mamba2_bytes``' projections; f = max(e, 4)): y, z and SiLU(z) in fp32, the
    product's fp32 copy 3 f di + f di (fp32 runs: z is a view of the in_proj output, e (di + ch +
    nh), in place of one f di), the rsqrt f per group, the normalised y and out_proj's input 2 e di."""
    f = max(e, 4)
    gate = f * di if e < f else e * (di + ch + nh)
    return 3 * f * di + gate + f * groups + 2 * e * di


def gated_deltanet_bytes(spec, tp: int, e: int, seq_len: int, chunk: int, norm) -> tuple[float, float]:
    """(bytes per token, bytes per block) of a Gated DeltaNet half (``model/gated_deltanet.py``).
    Local heads: key hk = H_k / tp of dim K, value hv = H_v / tp of dim V; key = hk K, val = hv V,
    ch = 2 key + val conv channels. ``norm(h, n_linears, ts)``: the block norm and the in_proj's input.

    projections: the conv's padded input e ch (T + W - 1) / T and SiLU's input e ch; l2norm of the
      repeated q and k, f hv K + f hv (rsqrt) each; beta (sigmoid output) e hv and its fp32 copy
      (bf16 only); the decay's softplus input and output 2 f hv; the gated output norm: fp32 o,
      normalised y, w y in fp32, SiLU(z) 3 f val, z in fp32 f val (fp32 runs: z itself, a view of
      the whole in_proj_qkvz output: ``gdn_z_is_view``), the rsqrt f hv, y and out_proj's input 2 e val
      (``gdn_gated_norm_bytes``).
    core (p): [U~ | W] f hv (V + K); decays 3 f hv + f hv / C. bf16 (autocast): D and I + A
      2 f hv C, (b K) K^T and Q K^T as bf16 2 m hv C, fp32 k, q, v f hv (2K + V), those matmuls'
      four operand casts 4 m hv K; per chunk the state cast twice 2 m hv K V / C, u cast twice
      (1 + late) m hv V, W, q e^g and K^T e^(..) casts 3 late m hv K, D Q K^T's cast m hv C, the
      fp32 states late f hv K V / C. fp32: five C-wide matrices 5 f hv C; fp32 k, q, the matmul
      copies (6 + 2 late) f hv K; u f hv V; v in chunks (a view of SiLU's output, f ch); the states
      f hv K V / C."""
    x = linear_dims(spec.mixers)
    hk, hv, dk, dv = x["k_heads"] / tp, x["v_heads"] / tp, x["k_dim"], x["v_dim"]
    key, val = hk * dk, hv * dv
    ch, c, n, p = 2 * key + val, *_chunks(seq_len, chunk)
    f = max(e, 4)
    proj = norm(spec.dim, NORM_LINEARS["gated_deltanet"]) + e * ch * (seq_len + x["conv"] - 1) / seq_len + e * ch
    proj += 2 * f * hv * (dk + 1) + e * hv + (f * hv if e < f else 0) + 2 * f * hv
    proj += gdn_gated_norm_bytes(e, key, val, hk, hv)
    late = (n - 1) / n  # per-chunk tensors of all but the first chunk, or of all but the last
    core = f * hv * (dv + dk) + 3 * f * hv + f * hv / c  # [U~ | W], decays
    if e == 2:  # bf16 autocast: every matmul casts its fp32 operands to bf16 copies (m = 2)
        m = 2
        core += 2 * f * hv * c + 2 * m * hv * c + f * hv * (2 * dk + dv) + 4 * m * hv * dk
        core += m * hv * c + 2 * m * hv * dk * dv / c + (1 + late) * m * hv * dv + 3 * late * m * hv * dk
        core += late * f * hv * dk * dv / c  # the fp32 states the decay product keeps
    else:
        core += 5 * f * hv * c + (6 + 2 * late) * f * hv * dk + f * hv * dv + f * hv * dk * dv / c
        core += f * val if e < f else f * ch
    return proj + p * core, 2 * c * c + 2 * f * hv  # the two masks; exp(A_log), -exp(A_log)


def mamba2_bytes(spec, tp: int, e: int, seq_len: int, chunk: int, norm) -> tuple[float, float]:
    """(bytes per token, bytes per block) of a Mamba-2 half (``model/mamba2.py``, SSD as decayed
    linear attention). Local: nh = n_h / tp heads of dim P, di = nh P, gn = (groups / tp) N_s
    (state N_s), conv channels ch = di + 2 gn, in_proj width di + ch + nh.

    projections: the conv's padded input e ch (T + W - 1) / T and SiLU's input e ch; SiLU's output
      e ch (x viewed, for the D skip); x in fp32 f di (bf16 only); dt's softplus input and output
      2 f nh; the gated norm RMSNorm(y SiLU(z)): y, z and SiLU(z) in fp32, the product's fp32 copy,
      3 f di + f di (fp32 runs: z is the in_proj output's view, e (di + ch + nh), for one f di),
      rsqrt f per group, the normalised y and out_proj's input 2 e di.
    core (p): D f nh C; decays 2 f nh + f nh / C. bf16 (autocast): fp32 C and B 2 f nh N_s, Q K^T's
      operand casts 2 m nh N_s and bf16 output m nh C; per chunk the state cast m nh N_s P / C,
      the fp32 states late f nh N_s P / C, C e^g and B e^(..)^T casts 2 late m nh N_s, D Q K^T's
      cast m nh C, v's casts (1 + late) m di. fp32: Q K^T and D Q K^T 2 f nh C, the matmul copies
      of C and B^T 2 f nh N_s, C and B (several local groups: own tensors) 2 f nh N_s, C e^g and
      B e^(..) (one local group: whole views 2 f nh N_s; several: per-chunk copies 2 late f nh
      N_s), v = dt x f di, the states f nh N_s P / C."""
    x = linear_dims(spec.mixers)
    nh, hp, ns = x["m_heads"] / tp, x["m_head_dim"], x["m_state"]
    groups = max(x["m_groups"] / tp, 1.0)
    di, gn = nh * hp, groups * ns
    ch, c, n, p = di + 2 * gn, *_chunks(seq_len, chunk)
    f = max(e, 4)
    proj = norm(spec.dim, NORM_LINEARS["mamba2"]) + e * ch * (seq_len + x["conv"] - 1) / seq_len + 2 * e * ch
    proj += (f * di if e < f else 0) + 2 * f * nh + mamba2_gated_norm_bytes(e, di, ch, nh, groups)
    # C and B per head: one group is an expand, its fp32 copy (bf16) contiguous, so the chunk slices
    # of C e^g and B e^(g_C - g) are views of one tensor each, and an fp32 run keeps SiLU's output
    # for them; several groups come transposed: own fp32 tensors, sliced to per-chunk copies
    # (all N for B, N - 1 for C)
    late = (n - 1) / n
    core = f * nh * c + 2 * f * nh + f * nh / c  # D, decays
    if e == 2:  # bf16 autocast: the matmuls' operands cast to bf16 copies (m = 2), chunk by chunk
        m = 2
        core += 2 * f * nh * ns + 2 * m * nh * ns + m * nh * c  # fp32 C, B; Q K^T's casts and output
        core += m * nh * ns * hp / c + late * f * nh * ns * hp / c + 2 * late * m * nh * ns
        core += m * nh * c + (1 + late) * m * di  # casts of D Q K^T and (twice) of v
    else:
        own = e < f or groups > 1
        slices = 2 if groups == 1 else 2 * late
        core += 2 * f * nh * c + (2 + (2 if own else 0) + slices) * f * nh * ns + f * di + f * nh * ns * hp / c
    return proj + p * core, c * c + 2 * f * nh  # the decay mask; exp(A_log), -exp(A_log)


def linear_bytes(spec, tp: int, e: int, seq_len: int, chunk: int, norm) -> tuple[float, float]:
    """(bytes per token, bytes per block) of causal linear attention (``model/linear_attention.py``,
    no decay: the decay factors are constants, so no gradient needs them or the raw q, k chunks).
    Local a = H / tp heads of dim D.

    projections: ELU's inputs (the q and k projections) 2 e a D; the normaliser's sum e a and the
      o it divides, [o | sum] e a (D + 1); wo's input e a D.
    core (p): D f a C; the constant decays 2 f a + f a / C. bf16 (autocast): Q K^T's operand
      casts 2 m a D; per chunk the state cast m a D (D + 1) / C, Q and K^T casts 2 late m a D,
      D Q K^T's cast m a C, [v | 1] cast twice (1 + late) m a (D + 1). fp32: the matmul copies of Q
      and K^T 2 f a D, D Q K^T f a C, [v | 1] f a (D + 1), per-chunk Q and K^T copies 2 late f a D,
      the states f a D (D + 1) / C."""
    a, d = spec.n_heads / tp, spec.head_dim
    c, n, p = _chunks(seq_len, chunk)
    f = max(e, 4)
    proj = norm(spec.dim, NORM_LINEARS["linear"]) + 2 * e * a * d + e * a + e * a * (d + 1) + e * a * d
    late = (n - 1) / n
    core = f * a * c + 2 * f * a + f * a / c  # D, decays
    if e == 2:  # bf16 autocast: the matmuls' operands cast to bf16 copies (m = 2), chunk by chunk
        m = 2
        core += 2 * m * a * d + m * a * d * (d + 1) / c + 2 * late * m * a * d + m * a * c
        core += (1 + late) * m * a * (d + 1)
    else:
        core += 2 * f * a * d + f * a * c + f * a * (d + 1) + 2 * late * f * a * d + f * a * d * (d + 1) / c
    return proj + p * core, 0.0


def sliding_window_bytes(spec, tp: int, e: int, seq_len: int, norm) -> tuple[float, float]:
    """(bytes per token, bytes per block) of sliding-window attention (``model/sliding_window.py``,
    blocks of w = min(window, T) queries against two key blocks, SDPA's flash kernel). Local a
    query and g kv heads of dim D; p = ceil(T / w) w / T.

    projections: q, k, v's shared input (the norm's output); RoPE's tables as for attention
      (``trainer_memory``'s ``rope``). core (p): the padded query blocks e a D; the doubled key and
      value blocks 2 x 2 e g D; the window mask as SDPA's additive mask in the compute dtype,
      e 2w; the log-sum-exp 4 a; the output e a D. wo's input: a view of that output when w
      divides T; else (a padded tail) its own copy of the real tokens, e a D."""
    a, g, d = spec.n_heads / tp, max(spec.n_kv_heads / tp, 1.0), spec.head_dim
    w = min(spec.mixers.swa_window, seq_len)
    p = math.ceil(seq_len / w) * w / seq_len
    lse = 8 if e == 8 else 4
    core = p * (2 * e * a * d + 4 * e * g * d + 2 * e * w + lse * a) + (e * a * d if p > 1 else 0.0)
    return norm(spec.dim, NORM_LINEARS["sliding_window"]) + core, 0.0


def dsa_bytes(spec, tp: int, e: int, seq_len: int, norm) -> tuple[float, float]:
    """(bytes per token, bytes per block) of DeepSeek sparse attention (``model/dsa.py``): the
    lightning indexer over all T keys, top-k selection, attention over the k gathered keys. Local
    a query and g kv heads of dim D (tp splits them; the indexer's H_I heads are whole), k =
    min(top_k, T).

    indexer: its rotated queries e H_I D and key e D (the einsum's operands), the ReLU'd per-head
      scores e H_I T, the head weights e H_I, the summed scores e T (``gather`` keeps its source);
      selection: the int64 indices 8 k and three bool masks of the invalid slots 3 k. attention: the
      rotated k and v e g D each (the gathers' sources), the query regrouped e a D, the gathered
      keys transposed and values e g k D each, the probabilities in fp32 f a k and as cast e a k,
      wo's input e a D; the indexer loss's log-softmax and target e k each. RoPE: the q / k and
      the indexer's tables (``trainer_memory``: twice attention's ``rope``)."""
    a, g, d = spec.n_heads / tp, max(spec.n_kv_heads / tp, 1.0), spec.head_dim
    hi, k = spec.mixers.dsa_index_heads, min(spec.mixers.dsa_top_k, seq_len)
    f = max(e, 4)
    index = e * hi * d + e * d + e * hi * seq_len + e * hi + e * seq_len + 8 * k + 3 * k
    attn = 2 * e * g * d + 2 * e * a * d + 2 * e * g * k * d + f * a * k + e * a * k + 2 * e * k
    return norm(spec.dim, NORM_LINEARS["dsa"]) + index + attn, 0.0


def mixer_half_bytes(spec, mixer: str, tp: int, e: int, seq_len: int, tokens: int, norm,
                     chunk: int | None = None) -> float:
    """Bytes one block's ``mixer`` half keeps for one microbatch of ``tokens`` tokens (``seq_len`` per
    sequence). ``chunk``: linear_chunk_size (None: the spec's, else ``DEFAULT_CHUNK``). Raises
    ValueError for a mixer not accounted here (attention is ``trainer_memory._attention``)."""
    chunk = resolve_chunk(spec, chunk)
    if mixer == "gated_deltanet":
        per, fixed = gated_deltanet_bytes(spec, tp, e, seq_len, chunk, norm)
    elif mixer == "mamba2":
        per, fixed = mamba2_bytes(spec, tp, e, seq_len, chunk, norm)
    elif mixer == "linear":
        per, fixed = linear_bytes(spec, tp, e, seq_len, chunk, norm)
    elif mixer == "sliding_window":
        per, fixed = sliding_window_bytes(spec, tp, e, seq_len, norm)
    elif mixer == "dsa":
        per, fixed = dsa_bytes(spec, tp, e, seq_len, norm)
    else:
        raise ValueError(f"no trainer accounting for mixer {mixer!r} (accounted: attention, {', '.join(MIXER_HALVES)})")
    return per * tokens + fixed


def rope_casts(mixer: str) -> int:
    """How many q / k pairs of RoPE table casts a block of ``mixer`` keeps: the softmax family rotates
    q and k (DSA its indexer's too), the linear mixers read no positions."""
    return {"attention": 1, "sliding_window": 1, "dsa": 2}.get(mixer, 0)
