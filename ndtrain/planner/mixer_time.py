"""Time of each token mixer kind of a hybrid (``model.layer_pattern``): its own projections and
its own sequence-mixing core, so a linear layer carries no T^2 term.

* softmax ``attention``: ``compute.attention_times`` (FlashAttention on the causal half of the
  T x T pairs) and the q / k / v / o projections of ``compute.attention_gemms``.
* ``sliding_window`` / ``dsa``: the same kernels over ``min(w, T)`` / ``min(k, T)`` keys (no
  causal halving: a window is full once T > w) plus DSA's indexer over all T keys.
* ``linear`` (Katharopoulos et al. 2020), ``mamba2`` (Dao & Gu 2024, SSD), ``gated_deltanet``
  (Yang et al. 2024): chunked state-passing kernels; the executed FLOPs are the state writes and
  reads of ``ndtrain.mixer_spec.mixer_seq_flops_per_token`` (constant per token), at the
  generation's ``attention_efficiency`` (the flash-linear-attention kernels are Triton tiles like
  FlashAttention's), bounded below by reading the mixer's inputs and writing its output once at
  HBM bandwidth; backward 2x the forward. Their projections are one GEMM of the mixer's own
  parameter count (``mixer_spec.mixer_params``) over h inputs, split by tp.

Units: seconds, FLOP/s, bytes/s. Per microbatch on one rank of ``tokens`` tokens.
"""
from __future__ import annotations

from collections import Counter

from ndtrain.mixer_spec import (
    LINEAR_MIXERS,
    layer_mixers,
    linear_dims,
    mixer_params,
    mixer_seq_flops_per_token,
)


def stage_mixers(spec, layers) -> tuple:
    """((kind, count), ...) of the blocks ``layers`` (indices) hold, sorted; all "attention" when
    the model has no ``layer_pattern``."""
    if not spec.mixers:
        return (("attention", len(layers)),) if len(layers) else ()
    kinds = layer_mixers(spec.mixers.layer_pattern, spec.n_layers)
    return tuple(sorted(Counter(kinds[i] for i in layers).items()))


def mixer_projection(spec, kind: str, tokens: float, tp: int) -> tuple[float, float, float, int]:
    """(m, n, k, count) of a linear-family mixer's projections as one h-wide GEMM on one rank."""
    n = mixer_params(spec.mixers, kind, spec.attn_params - spec.dim) / spec.dim
    return (tokens, n / tp, spec.dim, 1)


def _io_elements(spec, kind: str) -> float:
    """Elements per token a linear-family core reads (q, k, v, gates) and writes (o), all heads."""
    x = linear_dims(spec.mixers)
    if kind == "mamba2":
        return 2 * x["d_inner"] + 2 * x["m_groups"] * x["m_state"] + x["m_heads"]
    if kind == "gated_deltanet":
        return 2 * x["k_heads"] * x["k_dim"] + 2 * x["v_heads"] * x["v_dim"] + 2 * x["v_heads"]
    return 4 * spec.n_heads * (spec.dim // spec.n_heads)


def linear_core_times(spec, kind: str, tokens: float, tp: int, peak: float, hbm: float, c,
                      flat_rate: float, e: int = 2) -> tuple[float, float]:
    """(forward, backward) seconds of one linear-family layer's core on one rank: no T term.
    ``c`` None: the flat model, FLOPs at ``flat_rate`` and memory traffic free."""
    hd = spec.dim // spec.n_heads
    fwd_flops = mixer_seq_flops_per_token(spec.mixers, kind, 1, hd, hd) / 3.0 * tokens / tp
    if c is None:
        return fwd_flops / flat_rate, 2 * fwd_flops / flat_rate
    rate, bw = peak * c.attention_efficiency, hbm * c.hbm_efficiency
    io = tokens / tp * e * _io_elements(spec, kind)
    return max(fwd_flops / rate, io / bw), max(2 * fwd_flops / rate, 2 * io / bw)


def windowed_core_times(spec, kind: str, tokens: float, seq_len: int, tp: int, peak: float, c,
                        flat_rate: float) -> tuple[float, float]:
    """(forward, backward) seconds of a sliding-window or DSA layer's core (all its keys are
    executed: no causal halving); backward 2.5x the forward FLOPs as FlashAttention's."""
    d_qk = spec.head_dim + (spec.qk_rope_head_dim if spec.kv_lora_rank else 0)
    d_v = (spec.v_head_dim or spec.head_dim) if spec.kv_lora_rank else spec.head_dim
    fwd = mixer_seq_flops_per_token(spec.mixers, kind, seq_len, d_qk, d_v) / 3.0 * tokens / tp
    rate = flat_rate if c is None else peak * c.attention_efficiency
    return fwd / rate, 2.5 * fwd / rate


def is_linear(kind: str) -> bool:
    return kind in LINEAR_MIXERS
