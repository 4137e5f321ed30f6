"""FLOPs per token written out from the ``ModelConfig`` fields, apart from the planner's ``ModelSpec``.

The trainer's MFU and the planner share one count (``ModelSpec.flops_per_token``); this second,
independent spelling of the PaLM convention (Chowdhery et al. 2022, appendix B: ``6 N + 12 L H D T``,
N the active non-embedding parameters, the output head included) is the reference the parity tests
hold it to, for every preset. Mixer layers (``model.layer_pattern``) use ``ndtrain.mixer_spec``,
whose per-mixer terms are pinned by hand counts in ``tests/unit/test_hybrid_model.py``.
"""
from __future__ import annotations

from ndtrain import mixer_spec


def config_flops_per_token(cfg, seq_len: int) -> float:
    """Model FLOPs per trained token of ``cfg`` (a ``ModelConfig``) at sequence length ``seq_len``:
    MoE layers count the router, shared experts and top-k routed experts; MLA its low-rank
    projections and latent norms; MTP modules their projection, block, norms and one more head."""
    d, L, h = cfg.dim, cfg.n_layers, cfg.n_heads
    if cfg.attention == "mla":
        dn, dr = cfg.mla_nope_dim or cfg.head_dim, cfg.mla_rope_dim
        dv, qr, kr = cfg.mla_v_dim or cfg.head_dim, cfg.mla_q_rank, cfg.mla_kv_rank
        q = (d * qr + qr + qr * h * (dn + dr)) if qr else d * h * (dn + dr)
        attn = q + d * (kr + dr) + kr + kr * h * (dn + dv) + h * dv * d
        d_qk, d_v = dn + dr, dv
    else:
        hd, kv = cfg.head_dim, cfg.kv_heads
        attn = d * h * hd * 2 + d * kv * hd * 2 + (2 * hd if cfg.qk_norm else 0)  # wq, wo, wk, wv, q/k norms
        attn += d * h * hd if cfg.attn_output_gate else 0  # sigmoid output gate
        d_qk = d_v = hd

    def layer(i: int) -> int:
        if not cfg.block_ffn:  # mixer-only block (Mamba-2): one norm, no feed-forward
            return attn + d
        if cfg.is_moe_layer(i):
            ffn = d * cfg.moe_experts + 3 * d * (cfg.expert_ffn_dim * cfg.moe_top_k + cfg.shared_ffn_dim)
            ffn += d if cfg.moe_shared_gate and cfg.moe_shared_experts else 0
        else:
            ffn = 3 * d * cfg.ffn_dim
        return attn + ffn + 2 * d  # + two norms

    head = cfg.vocab_size * d
    n = sum(layer(i) for i in range(L)) + d + head  # + final norm + output head
    n += cfg.mtp_depth * (layer(L - 1) + 2 * d * d + 3 * d + head)  # MTP: block, proj, norms, head
    n += mixer_spec.param_delta(cfg, attn)
    mixing = mixer_spec.seq_flops_total(cfg, seq_len, d_qk, d_v)
    return 6.0 * n + mixing + 6.0 * cfg.mtp_depth * h * (d_qk + d_v) * seq_len
