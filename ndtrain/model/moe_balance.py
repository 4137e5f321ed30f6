"""MoE load balancing: auxiliary losses, load statistics, the aux-loss-free bias update (docs/moe.md,
"Load balancing" and its scopes).

Switch loss (Fedus 2021, eq. 4, top-k form) ``E * sum_i f_i * P_i``; sequence-wise loss
(DeepSeek-V3, eq. 17-20); router z-loss (ST-MoE, Zoph 2022). Each is produced as a token sum and
divided by the global routed tokens, so the total does not depend on the layout where its scope
does not (``moe_aux_scope``: "microbatch" | "global"). ``f`` is a count: gradients flow through
``P`` only. Aux-loss-free balancing (DeepSeek-V3; Wang et al. 2024): after each step
``b_i += rate * sign(mean_load - load_i)``; ``b`` only biases selection."""
from __future__ import annotations

from collections.abc import Callable

import torch

AUX_TERMS = ("switch", "seq", "z")


class LoadStats:
    """One layer's counters over a step's training forwards; reset by ``end_step``. ``counts`` (E,)
    float64: demand before dropping; ``dropped`` / ``assigned``; ``terms``: unweighted aux token sums;
    ``a2a_bytes``: bytes this rank sent in the layer's ep all-to-alls (recompute included)."""

    def __init__(self, n_experts: int):
        self.n_experts = n_experts
        self.reset()

    def reset(self) -> None:
        self.counts: torch.Tensor | None = None
        self.dropped = 0.0
        self.assigned = 0.0
        self.recorded = 0  # recording forwards (a rank whose tokens are all masked still counts one)
        self.terms: dict[str, float] = {}
        self.a2a_bytes = 0.0


def record(moe, logits: torch.Tensor, scores: torch.Tensor, idx: torch.Tensor,
           keep: torch.Tensor | None, shape: tuple[int, int], update_stats: bool = True,
           valid: torch.Tensor | None = None) -> torch.Tensor | None:
    """The weighted aux-loss token sum (None without aux loss); with ``update_stats`` also add this
    forward's loads to ``moe.stats``. logits / scores (N, E), idx (N, k), keep (N, k) or None, shape
    (B, T) with N = B*T, valid (N,) bool or None (masked tokens leave every count and loss)."""
    c, st = moe.cfg, moe.stats
    e = scores.shape[1]
    sel = idx if valid is None else idx[valid]  # (N_valid, k) assignments that count
    counts = torch.bincount(sel.reshape(-1), minlength=e).to(torch.float64)  # (E,)
    if update_stats:
        st.counts = counts if st.counts is None else st.counts + counts
        st.assigned += sel.numel()
        st.recorded += 1
        if keep is not None:
            st.dropped += float((~keep).sum()) if valid is None else float((~keep[valid]).sum())
    probs = scores if c.moe_score == "softmax" else scores / scores.sum(-1, keepdim=True)  # (N, E)
    terms: dict[str, torch.Tensor] = {}
    if c.moe_aux_loss_coef > 0:
        cnt = counts
        if moe.load_reducer is not None:  # (E,) summed over the scope's ranks (set by parallel code)
            cnt = moe.load_reducer(counts.clone())
        f = (cnt / cnt.sum().clamp(min=1)).to(probs.dtype)  # (E,) fraction of assignments
        p_sum = probs.sum(0) if valid is None else probs[valid].sum(0)  # (E,)
        terms["switch"] = (c.moe_aux_loss_coef, e * (f * p_sum).sum())
    if c.moe_seq_aux_loss_coef > 0:
        terms["seq"] = (c.moe_seq_aux_loss_coef, _seq_term(moe, probs, idx, shape, valid))
    if c.moe_z_loss_coef > 0:
        z_logits = logits if valid is None else logits[valid]
        terms["z"] = (c.moe_z_loss_coef, torch.logsumexp(z_logits, dim=-1).pow(2).sum())
    if not terms:
        return None
    total = None
    for name, (coef, value) in terms.items():
        if update_stats:
            st.terms[name] = st.terms.get(name, 0.0) + float(value.detach())
        total = coef * value if total is None else total + coef * value
    return total


def _seq_term(moe, probs: torch.Tensor, idx: torch.Tensor, shape: tuple[int, int],
              valid: torch.Tensor | None) -> torch.Tensor:
    """Sequence-wise loss token sum (DeepSeek-V3 eq. 17-20): probs (N, E), idx (N, k), shape (B, T),
    valid (N,) or None. Under cp the (B, E) counts and (B,) valid lengths are summed over the shards."""
    b, t = shape
    k = idx.shape[1]
    e = probs.shape[1]
    shards = moe.seq_shards if moe.seq_shards is not None and moe.seq_shards.size > 1 else None
    ones = torch.ones(b, t * k, dtype=probs.dtype, device=probs.device)
    if valid is None:
        cnt_seq = probs.new_zeros(b, e).scatter_add_(1, idx.view(b, t * k), ones)  # (B, E)
        t_seq = t  # the whole sequence's length
        if shards is not None:  # cp: count over the whole sequences
            cnt_seq, t_seq = shards.all_reduce(cnt_seq), t * shards.size
        f_seq = cnt_seq * (e / (k * t_seq))  # (B, E)
        return (f_seq * probs.view(b, t, e).sum(1)).sum()
    v = valid.view(b, t)
    src = ones.view(b, t, k) * v.unsqueeze(-1).to(probs.dtype)  # (B, T, k): masked tokens add 0
    cnt_len = probs.new_zeros(b, e + 1)  # (B, E) counts and (B,) valid length, one reduction
    cnt_len[:, :e].scatter_add_(1, idx.view(b, t * k), src.view(b, t * k))
    cnt_len[:, e] = v.sum(1).to(probs.dtype)
    if shards is not None:
        cnt_len = shards.all_reduce(cnt_len)
    t_seq = cnt_len[:, e:].clamp(min=1)  # (B, 1) valid tokens of each sequence
    # tensor / tensor (one rounding, as the unmasked Python-float scale); ``e / tensor`` would not be
    f_seq = cnt_len[:, :e] * (torch.full_like(t_seq, float(e)) / (k * t_seq))  # (B, E)
    return (f_seq * probs.masked_fill(~valid.unsqueeze(1), 0).view(b, t, e).sum(1)).sum()


def moe_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every MoE module of ``model`` in registration order (empty if dense), found by attribute: this
    module cannot import ``moe``, which imports it."""
    return [m for m in model.modules() if isinstance(getattr(m, "stats", None), LoadStats)]


def pop_aux_loss(model: torch.nn.Module) -> torch.Tensor | None:
    """Sum and clear the ``aux_sum`` of every MoE layer of ``model`` (None if there is none)."""
    total = None
    for m in moe_layers(model):
        if m.aux_sum is not None:
            total = m.aux_sum if total is None else total + m.aux_sum
            m.aux_sum = None
    return total


@torch.no_grad()
def end_step(model: torch.nn.Module, all_reduce: Callable[[torch.Tensor], object] | None,
             bias_update_rate: float, ep: int = 1) -> dict[str, float]:
    """After the optimizer step: reduce load statistics, update expert biases, reset counters.

    ``all_reduce``: in-place float64 sum over ``dp_cp`` (None in one process), called once with every
    layer's counters packed; ``bias_update_rate``: the aux-loss-free step (0 = none); ``ep``: the expert-
    parallel degree (rank r holds experts [r E/ep, (r+1) E/ep)). Returns (empty if dense)
    ``moe_load_max_mean`` (max/mean load, mean over layers), ``moe_load_max_mean_worst``,
    ``moe_tokens_per_expert_max`` / ``_mean`` and ``moe_tokens_per_ep_rank_max`` / ``_mean``
    (assignments of the global batch before dropping; max over layers / mean over layers), ``moe_dropped_frac``,
    ``moe_a2a_bytes`` (all layers and ranks; 0 without ep) and ``aux_<name>_sum`` per ``AUX_TERMS``
    (unweighted token sums over the global batch and all layers)."""
    layers = [m for m in moe_layers(model) if m.stats.counts is not None]
    if not layers:
        return {}
    e, extra = layers[0].n_experts, 3 + len(AUX_TERMS)
    rows = []
    for m in layers:
        st = m.stats
        tail = [st.dropped, st.assigned, st.a2a_bytes] + [st.terms.get(name, 0.0) for name in AUX_TERMS]
        rows.append(torch.cat([st.counts.cpu(), torch.tensor(tail, dtype=torch.float64)]))
    packed = torch.cat(rows).to(layers[0].expert_bias.device)  # (L_moe * (E + 6),)
    if all_reduce is not None:
        all_reduce(packed)
    ratios, dropped, assigned, a2a, peak, means = [], 0.0, 0.0, 0.0, 0.0, []
    rank_peak, rank_means = 0.0, []
    terms = dict.fromkeys(AUX_TERMS, 0.0)
    for i, m in enumerate(layers):
        row = packed[i * (e + extra):(i + 1) * (e + extra)]
        counts = row[:e]  # (E,) load of this step over the global batch
        mean = counts.mean()
        ratios.append(float(counts.max() / mean.clamp(min=1e-12)))
        peak, means = max(peak, float(counts.max())), means + [float(mean)]
        per_rank = counts.view(ep, e // ep).sum(1)  # (ep,) assignments each ep rank's experts received
        rank_peak, rank_means = max(rank_peak, float(per_rank.max())), rank_means + [float(per_rank.mean())]
        dropped, assigned, a2a = dropped + float(row[e]), assigned + float(row[e + 1]), a2a + float(row[e + 2])
        for j, name in enumerate(AUX_TERMS):
            terms[name] += float(row[e + 3 + j])
        if bias_update_rate > 0:
            m.expert_bias += (bias_update_rate * torch.sign(mean - counts)).to(m.expert_bias.dtype)
        m.stats.reset()
    out = {"moe_load_max_mean": sum(ratios) / len(ratios), "moe_load_max_mean_worst": max(ratios),
           "moe_tokens_per_expert_max": peak, "moe_tokens_per_expert_mean": sum(means) / len(means),
           "moe_tokens_per_ep_rank_max": rank_peak, "moe_tokens_per_ep_rank_mean": sum(rank_means) / len(rank_means),
           "moe_dropped_frac": dropped / max(assigned, 1.0), "moe_a2a_bytes": a2a}
    out.update({f"aux_{name}_sum": v for name, v in terms.items()})
    return out
