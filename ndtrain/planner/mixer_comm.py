"""Context-parallel traffic of each token mixer kind, in bytes one cp rank sends per layer, as
ndtrain's runtime moves it (``parallel/cp``), and its seconds on the cp link.

Per layer and microbatch, ``seqs`` sequences of T tokens, n = cp, T_l = T / n, one tp rank's heads
(H, G, H_v, ... divided by tp), e = bytes of an activation, s = bytes of the kernels' accumulation
dtype (float32 for bf16 / fp32 runs, float64 for float64):

    attention, ring (``ring.py``)   forward (n-1) blocks of [K | V], (seqs, G, T_l, D_k + D_v) x e;
                                    backward (n-1) such blocks again + n dK / dV accumulators (x s)
    attention, ulysses              all-to-all of q, k, v in and o out (forward; backward alike)
    linear / mamba2 / gated_deltanet (``state_passing.py``): all-gather of each rank's packed state
                                    (n-1) x P x s forward, its gradient reduce-scattered backward;
                                    P = seqs H (D (D+1) + 1) | seqs n_h (N P_h + 1) | seqs H_v K (K + V)
    short convolution / window (``window.py``): the previous rank's last W-1 inputs (mamba2:
                                    d_inner + 2 g N channels; gated_deltanet: 2 H_k K + H_v V) or
                                    w-1 keys and values (2 G D), forward by every rank but the
                                    last, their gradients backward by every rank but the first

State passing does not grow with T (docs/attention_alternatives.md, "Context parallel by state
passing"); the ring's blocks do. ``tests/parallel/test_mixers_cp.py`` checks these bytes against
the counted traffic of every rank of a hybrid trained under cp.
"""
from __future__ import annotations

from ndtrain.mixer_spec import linear_dims

SOFTMAX = ("attention", "dsa")


def _acc_bytes(e: int) -> int:
    """Bytes of the kernels' accumulation dtype for activations of e bytes (fp64 stays fp64)."""
    return 8 if e == 8 else 4


def _state_elements(spec, kind: str, tp: int) -> float:
    """Elements of one sequence's packed state on one tp rank (the all-gathered unit)."""
    if kind == "linear":
        h, d = spec.n_heads / tp, spec.dim // spec.n_heads
        return h * (d * (d + 1) + 1)
    x = linear_dims(spec.mixers)
    if kind == "mamba2":
        return x["m_heads"] / tp * (x["m_state"] * x["m_head_dim"] + 1)
    return x["v_heads"] / tp * x["k_dim"] * (x["k_dim"] + x["v_dim"])  # gated_deltanet


def _halo_elements(spec, kind: str, tp: int) -> float:
    """Elements of one sequence the previous rank hands on (0: none)."""
    if kind == "sliding_window":
        g = max(spec.n_kv_heads / tp, 1.0)
        return (spec.mixers.swa_window - 1) * 2 * g * spec.head_dim
    if kind == "linear":
        return 0.0
    x = linear_dims(spec.mixers)
    ch = x["d_inner"] + 2 * x["m_groups"] * x["m_state"] if kind == "mamba2" else \
        2 * x["k_heads"] * x["k_dim"] + x["v_heads"] * x["v_dim"]
    return (x["conv"] - 1) * ch / tp


def cp_layer_bytes(spec, kind: str, seqs: float, seq_len: int, cp: int, tp: int = 1, e: int = 2,
                   cp_impl: str = "ring", position: str = "middle") -> tuple[float, float]:
    """(forward, backward) bytes one cp rank sends for one layer of ``kind`` over ``seqs``
    sequences of ``seq_len`` tokens (module docstring). ``position``: first, middle or last cp rank
    (the halo exchanges skip the ends). 0 when cp == 1. Raises ValueError for a softmax kind under an
    impl other than ring / ulysses / allgather, or an unknown position."""
    if cp <= 1:
        return 0.0, 0.0
    if position not in ("first", "middle", "last"):
        raise ValueError(f"position {position!r}: first, middle or last")
    s = _acc_bytes(e)
    t_l = seq_len / cp
    if kind in SOFTMAX:
        g = max(spec.n_kv_heads / tp, 1.0)
        d_qk = spec.head_dim + spec.qk_rope_head_dim
        d_v = spec.v_head_dim or spec.head_dim
        block = seqs * g * t_l * (d_qk + d_v)
        if cp_impl == "ring":
            return (cp - 1) * block * e, (cp - 1) * block * e + cp * block * s
        if cp_impl == "allgather":  # Llama 3: K, V gathered; dK, dV reduce-scattered
            return (cp - 1) * block * e, (cp - 1) * block * e * 2
        if cp_impl == "ulysses":  # q, k, v in, o out; (n-1)/n of what a rank holds leaves it
            a = spec.n_heads / tp
            held = seqs * t_l * (a * d_qk + g * (d_qk + d_v) + a * d_v) * e
            return (cp - 1) / cp * held, (cp - 1) / cp * held
        raise ValueError(f"cp_impl {cp_impl!r}: ring, allgather or ulysses")
    state, halo = _linear_parts(spec, kind, seqs, cp, tp, e)
    fwd = state + (position != "last") * halo
    bwd = state + (position != "first") * halo
    return fwd, bwd


def _linear_parts(spec, kind: str, seqs: float, cp: int, tp: int, e: int) -> tuple[float, float]:
    """(state all-gather bytes a rank sends, one halo message's bytes) of a non-softmax layer."""
    s = _acc_bytes(e)
    halo = _halo_elements(spec, kind, tp) * seqs * e
    state = 0.0 if kind == "sliding_window" else (cp - 1) * _state_elements(spec, kind, tp) * seqs * s
    return state, halo


def cp_stage_seconds(spec, links, mixers: tuple, seqs: float, seq_len: int, cp: int, tp: int, e: int,
                     cp_impl: str, t_attn_layer: float) -> tuple[float, float]:
    """(forward, backward) exposed cp seconds of one microbatch on a stage holding ``mixers``
    ((kind, count), ...; ``mixer_time.stage_mixers``). ``links``: ``comm.Links`` of the layout.
    The ring's hops overlap their block's attention (forward ``t_attn_layer``, backward 2.5x);
    state all-gathers and halo exchanges are on the critical path (the composition and the
    convolution wait for them)."""
    fwd = bwd = 0.0
    if cp <= 1:
        return fwd, bwd
    for kind, count in mixers:
        f, b = cp_layer_bytes(spec, kind, seqs, seq_len, cp, tp, e, cp_impl)
        if kind in SOFTMAX:
            if cp_impl == "ring":
                hop_f, hop_b = links.time("send", "cp", f / (cp - 1), 2), links.time("send", "cp", b / (2 * cp - 1), 2)
                fwd += count * max(0.0, (cp - 1) * hop_f - t_attn_layer)
                bwd += count * max(0.0, (2 * cp - 1) * hop_b - 2.5 * t_attn_layer)
            else:
                kind_c = "all_to_all" if cp_impl == "ulysses" else "all_gather"
                fwd += count * links.time(kind_c, "cp", f * cp / (cp - 1), cp)
                bwd += count * links.time(kind_c, "cp", b * cp / (cp - 1), cp)
            continue
        state, halo = _linear_parts(spec, kind, seqs, cp, tp, e)
        gathered = state * cp / (cp - 1)  # the whole stack, as the collective is sized
        fwd += count * (links.time("send", "cp", halo, 2) + links.time("all_gather", "cp", gathered, cp))
        bwd += count * (links.time("send", "cp", halo, 2) + links.time("reduce_scatter", "cp", gathered, cp))
    return fwd, bwd
