"""Which token mixer each layer uses, and what each mixer costs: pure Python (no torch), shared by
the model (``ndtrain.model.mixers``), validation, ``ndtrain.train.metrics.flops_per_token`` and the
planner's model spec, so all of them count the same parameters and FLOPs.

``model.layer_pattern`` is either a string of letters, repeated over the layers (its length must
divide ``n_layers``), or a comma list of mixer names (same rule). Letters:

    A attention (softmax, MHA / GQA / MLA)       L linear (Katharopoulos 2020, elu+1)
    M mamba2 (Dao & Gu 2024, SSD)                G gated_deltanet (Yang et al. 2024)
    S sliding_window (causal window w)           D dsa (DeepSeek-V3.2-Exp sparse attention)

Empty means every layer is softmax attention. E.g. ``"GGGA"`` is Qwen3-Next's 3:1 hybrid.

FLOPs follow the PaLM convention of ``ndtrain.train.metrics``: 6 per parameter per token (forward 2,
backward 4) plus, per layer, a sequence-mixing term counted as 6 x its multiply-adds per token:

    attention        6 H (d_qk + d_v) T            (all T x T pairs, causal half not subtracted)
    sliding_window   6 H 2D min(w, T)
    dsa              6 H 2D min(k, T) + 6 H_I D T  (top-k attention + the indexer over all keys)
    linear           6 H 2 D (D + 1)               (state write k v^T and read q^T S; +1 normaliser)
    mamba2           6 n_h 2 N P                   (state write and read, N x P state per head)
    gated_deltanet   6 H_v 3 K V                   (read S^T k, write, read S^T q; K x V state)

so the linear mixers have no T term.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

MIXER_LETTERS = {"A": "attention", "L": "linear", "M": "mamba2", "G": "gated_deltanet",
                 "S": "sliding_window", "D": "dsa"}
MIXERS = tuple(MIXER_LETTERS.values())
LINEAR_MIXERS = ("linear", "mamba2", "gated_deltanet")  # recurrent state instead of a KV cache


def parse_pattern(pattern: str) -> list[str]:
    """One period of ``pattern`` as mixer names; raises ValueError for an unknown letter / name."""
    pattern = pattern.strip()
    if not pattern:
        return ["attention"]
    if "," in pattern or pattern.lower() in MIXERS:
        names = [p.strip().lower() for p in pattern.split(",") if p.strip()]
        bad = [n for n in names if n not in MIXERS]
    else:
        bad = [c for c in pattern if c.upper() not in MIXER_LETTERS]
        names = [MIXER_LETTERS.get(c.upper(), c) for c in pattern]
    if bad or not names:
        raise ValueError(f"model.layer_pattern ({pattern!r}): unknown mixer(s) {bad}; letters "
                         f"{dict(MIXER_LETTERS)} or a comma list of those names")
    return names


def layer_mixers(pattern: str, n_layers: int) -> list[str]:
    """Mixer name of each of the ``n_layers`` layers (the pattern repeated; a partial last period
    is allowed here, e.g. for a count over the first layers; ``check_mixers`` requires whole ones).

    Raises ValueError if the pattern is unknown.
    """
    period = parse_pattern(pattern)
    return [period[i % len(period)] for i in range(n_layers)]


def linear_dims(m) -> dict[str, int]:
    """Head counts / dims of the linear-family mixers from a ``ModelConfig``-like ``m`` (0 fields
    fall back to the attention shape)."""
    hk = m.linear_heads or m.n_heads
    dk = m.linear_key_head_dim or m.dim // m.n_heads
    d_inner = m.mamba_expand * m.dim
    p = m.mamba_head_dim or m.dim // m.n_heads
    return {"k_heads": hk, "k_dim": dk, "v_heads": m.linear_value_heads or hk,
            "v_dim": m.linear_value_head_dim or dk, "conv": m.linear_conv_kernel,
            "d_inner": d_inner, "m_heads": d_inner // p, "m_head_dim": p, "m_state": m.mamba_state_dim,
            "m_groups": getattr(m, "mamba_groups", 1)}


def mixer_params(m, kind: str, attention_params: int) -> int:
    """Parameters of one layer's token mixer (the block's norms excluded). ``attention_params`` is
    the softmax attention's own count (the caller knows MHA / GQA / MLA)."""
    d, x = m.dim, linear_dims(m)
    if kind in ("attention", "sliding_window"):
        return attention_params
    if kind == "dsa":  # + indexer: query heads, one shared key, per-head weights
        hd = d // m.n_heads
        return attention_params + d * m.dsa_index_heads * hd + d * hd + d * m.dsa_index_heads
    if kind == "linear":
        return 4 * d * m.n_heads * (d // m.n_heads)
    if kind == "mamba2":
        di, gn, nh, kc = x["d_inner"], x["m_groups"] * x["m_state"], x["m_heads"], x["conv"]
        conv_ch = di + 2 * gn
        return d * (2 * di + 2 * gn + nh) + conv_ch * (kc + 1) + 3 * nh + di + di * d
    if kind == "gated_deltanet":
        key, val, hv = x["k_heads"] * x["k_dim"], x["v_heads"] * x["v_dim"], x["v_heads"]
        return d * (2 * key + 2 * val) + d * 2 * hv + (2 * key + val) * x["conv"] + 2 * hv + x["v_dim"] + val * d
    raise ValueError(f"unknown mixer {kind!r}")


def mixer_seq_flops_per_token(m, kind: str, seq_len: int, d_qk: int, d_v: int) -> float:
    """The sequence-mixing FLOPs per token (forward + backward) of one layer; see module docstring.
    ``d_qk`` / ``d_v`` are the softmax attention's per-head query-key / value dims."""
    h, x = m.n_heads, linear_dims(m)
    if kind == "attention":
        return 6.0 * h * (d_qk + d_v) * seq_len
    if kind == "sliding_window":
        return 6.0 * h * (d_qk + d_v) * min(m.swa_window, seq_len)
    if kind == "dsa":
        return 6.0 * h * (d_qk + d_v) * min(m.dsa_top_k, seq_len) + 6.0 * m.dsa_index_heads * d_qk * seq_len
    if kind == "linear":
        hd = m.dim // h
        return 6.0 * h * 2 * hd * (hd + 1)
    if kind == "mamba2":
        return 6.0 * x["m_heads"] * 2 * x["m_state"] * x["m_head_dim"]
    if kind == "gated_deltanet":
        return 6.0 * x["v_heads"] * 3 * x["k_dim"] * x["v_dim"]
    raise ValueError(f"unknown mixer {kind!r}")


def non_softmax_mixers(m) -> tuple[str, ...]:
    """The mixers other than softmax attention that ``m.layer_pattern`` uses, sorted (() if none)."""
    return tuple(sorted(set(parse_pattern(m.layer_pattern)) - {"attention"}))


def check_mixer_layout(mixers: tuple[str, ...], cp: int = 1) -> None:
    """Parallel composition of the non-softmax mixers (ZeRO, DDP, activation checkpointing, bf16
    and pp need nothing from a mixer: they are per-layer modules; tp splits each by heads, its
    head-count rule is ``ndtrain.parallel.tp.rules.check_mixer_heads``). Raises ``ConfigError``
    naming the rule."""
    from ndtrain.errors import require

    # cp: linear mixers pass states, sliding windows their last keys (ndtrain.parallel.cp.rules)
    require(cp == 1 or "dsa" not in mixers, "model.layer_pattern with dsa needs cp == 1 (the indexer "
                                            "scores every earlier key: not built under cp)")


def check_mixers(m) -> None:
    """Rules of ``model.layer_pattern`` and the mixer fields of a ``ModelConfig``-like ``m``;
    raises ``ConfigError`` naming the rule (the layout rules are ``check_mixer_layout``)."""
    from ndtrain.errors import ConfigError, require

    try:
        period = parse_pattern(m.layer_pattern)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    require(m.n_layers % len(period) == 0, f"model.layer_pattern ({m.layer_pattern!r}) has {len(period)} "
                                           f"layers, which does not divide n_layers ({m.n_layers})")
    kinds = set(period)
    if kinds == {"attention"}:
        return
    require(m.attention == "mha", f"model.layer_pattern with mixers other than attention needs "
                                  f"attention: mha (got {m.attention})")
    require(m.mtp_depth == 0, "model.layer_pattern with mixers other than attention needs mtp_depth == 0")
    require(m.linear_chunk_size >= 1, f"model.linear_chunk_size ({m.linear_chunk_size}) must be >= 1")
    x = linear_dims(m)
    if "gated_deltanet" in kinds:
        require(x["v_heads"] % x["k_heads"] == 0, f"linear_value_heads ({x['v_heads']}) must be a multiple "
                                                  f"of linear_heads ({x['k_heads']})")
    if kinds & {"mamba2", "gated_deltanet"}:
        require(m.linear_conv_kernel >= 1, f"linear_conv_kernel ({m.linear_conv_kernel}) must be >= 1")
    if "mamba2" in kinds:
        require(m.mamba_expand >= 1 and x["d_inner"] % x["m_head_dim"] == 0,
                f"mamba_expand * dim ({x['d_inner']}) must be a positive multiple of mamba_head_dim "
                f"({x['m_head_dim']})")
        require(m.mamba_state_dim >= 1, f"mamba_state_dim ({m.mamba_state_dim}) must be >= 1")
        require(m.mamba_groups >= 1 and x["m_heads"] % m.mamba_groups == 0,
                f"mamba_groups ({m.mamba_groups}) must be >= 1 and divide the mamba2 heads ({x['m_heads']})")
    if "sliding_window" in kinds:
        require(m.swa_window >= 1, f"layer_pattern uses sliding_window: swa_window ({m.swa_window}) must be >= 1")
    if "dsa" in kinds:
        require(m.dsa_top_k >= 1, f"layer_pattern uses dsa: dsa_top_k ({m.dsa_top_k}) must be >= 1")
        require(m.dsa_index_heads >= 1, f"dsa_index_heads ({m.dsa_index_heads}) must be >= 1")


@dataclass(frozen=True)
class MixerFields:
    """The ``ModelConfig`` fields the mixer counts read (hashable, for the planner's ``ModelSpec``)."""

    dim: int
    n_layers: int
    n_heads: int
    layer_pattern: str = ""
    linear_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_heads: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 4
    mamba_state_dim: int = 16
    mamba_head_dim: int = 0
    mamba_expand: int = 2
    mamba_groups: int = 1
    swa_window: int = 0
    dsa_top_k: int = 0
    dsa_index_heads: int = 4
    linear_chunk_size: int = 64

    @classmethod
    def from_model_config(cls, m) -> MixerFields | None:
        """None when every layer is softmax attention (nothing to change in the counts)."""
        if set(layer_mixers(m.layer_pattern, m.n_layers)) == {"attention"}:
            return None
        return cls(**{f.name: getattr(m, f.name) for f in fields(cls)})


def param_delta(m, attention_params: int) -> int:
    """Parameters of all layers' mixers minus ``n_layers`` softmax attentions of
    ``attention_params`` each (what a count that assumed attention everywhere must add)."""
    return sum(mixer_params(m, k, attention_params) - attention_params
               for k in layer_mixers(m.layer_pattern, m.n_layers))


def seq_flops_total(m, seq_len: int, d_qk: int, d_v: int) -> float:
    """Sum over layers of ``mixer_seq_flops_per_token`` (FLOPs per token, forward + backward)."""
    return sum(mixer_seq_flops_per_token(m, k, seq_len, d_qk, d_v)
               for k in layer_mixers(m.layer_pattern, m.n_layers))


def stage_seq_costs(m, seq_len: int) -> list[float]:
    """Forward sequence-mixing FLOPs per token of each layer, as the pipeline balance counts them
    (``parallel/pp/stage.layer_costs`` and the planner's split alike, on top of 2 x the block's
    parameters): 4 T C for softmax attention, a third of ``mixer_seq_flops_per_token`` (the
    forward share of forward + backward) for the other mixers, so a linear layer has no T term
    and a window layer min(w, T). ``m``: a ``ModelConfig`` / ``MixerFields``."""
    hd = m.dim // m.n_heads
    return [4.0 * seq_len * m.dim if kind == "attention" else mixer_seq_flops_per_token(m, kind, seq_len, hd, hd) / 3
            for kind in layer_mixers(m.layer_pattern, m.n_layers)]
