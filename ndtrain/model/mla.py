"""Multi-head Latent Attention (MLA; DeepSeek-V2, 2024, section 2.1), as used by DeepSeek-V3.

Keys and values come from one low-rank latent per token; RoPE, which would not commute with the
up-projection, goes on a decoupled slice (one RoPE key shared by the heads):

    q  = W_uq RMSNorm(W_dq x)      -> per head [q_nope (d_n), q_rope (d_r)]  (or q = W_q x)
    [c_kv, k_rope] = W_dkv x        c_kv (d_c), k_rope (d_r) shared by the heads
    [k_nope, v] = W_ukv RMSNorm(c_kv) per head: k_nope (d_n), v (d_v)
    attention(q = [q_nope, rope(q_rope)], k = [k_nope, rope(k_rope)], v), scale 1/sqrt(d_n + d_r)

The cache holds only c_kv and the rotated k_rope, (d_c + d_r) values per token and layer, in the
ordinary ``KVCache`` (latent as a 1-head key, k_rope as a 1-head value); no matrix absorption.
``enter_heads`` separates the replicated latent path from the per-head projections (tp splits
there, ``tp.plan``); ``core`` is cp's hook. ``ndtrain.hf.moe`` permutes interleaved RoPE rows."""
from __future__ import annotations

import torch
from torch import nn

from ndtrain.config import ModelConfig
from ndtrain.model.attention import KVCacheLike, causal_attention
from ndtrain.model.documents import document_attention
from ndtrain.model.norm import RMSNorm
from ndtrain.model.rope import apply_rope

LATENT_NORM_EPS = 1e-6  # eps of the latent RMSNorms, fixed as in DeepSeek's code (not cfg.norm_eps)


class MLAttention(nn.Module):
    """DeepSeek-V2 MLA: x (B, T, C), cos / sin (T, d_r/2) or (B, T, d_r/2) -> (B, T, C). ``cfg``:
    ``mla_kv_rank`` d_c, ``mla_q_rank`` (0 = no query latent), ``mla_rope_dim`` d_r, ``mla_nope_dim``
    d_n, ``mla_v_dim`` d_v (0 = head_dim)."""

    def __init__(self, cfg: ModelConfig, layer_id: str = "0"):
        super().__init__()
        h, c = cfg.n_heads, cfg.dim
        self.layer_id = layer_id
        self.nope_dim = cfg.mla_nope_dim or cfg.head_dim
        self.rope_dim = cfg.mla_rope_dim
        self.v_dim = cfg.mla_v_dim or cfg.head_dim
        self.kv_rank = cfg.mla_kv_rank
        qk = self.nope_dim + self.rope_dim
        if cfg.mla_q_rank:
            self.wq_a = nn.Linear(c, cfg.mla_q_rank, bias=False)  # (d_q, C)
            self.q_norm = RMSNorm(cfg.mla_q_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(cfg.mla_q_rank, h * qk, bias=False)  # (H*(d_n+d_r), d_q)
        else:
            self.wq = nn.Linear(c, h * qk, bias=False)  # (H*(d_n+d_r), C)
        self.wkv_a = nn.Linear(c, self.kv_rank + self.rope_dim, bias=False)  # (d_c+d_r, C)
        self.kv_norm = RMSNorm(self.kv_rank, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(self.kv_rank, h * (self.nope_dim + self.v_dim), bias=False)  # (H*(d_n+d_v), d_c)
        self.wo = nn.Linear(h * self.v_dim, c, bias=False)  # (C, H*d_v)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             documents: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention: q, k (B, H, T, d_n+d_r), v (B, H, T, d_v) -> (B, H, T, d_v); block-causal
        with ``documents`` (B, T)."""
        return causal_attention(q, k, v) if documents is None else document_attention(q, k, v, documents)

    def expand_kv(self, c_kv: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """c_kv (B, S, d_c) (normalised), k_rope (B, S, d_r) -> k (B, H, S, d_n+d_r), v (B, H, S, d_v)."""
        b, s, _ = c_kv.shape
        kv = self.wkv_b(c_kv).view(b, s, -1, self.nope_dim + self.v_dim)  # (B, S, H, d_n+d_v)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        h = kv.shape[2]
        k = torch.cat([k_nope, k_rope.unsqueeze(2).expand(b, s, h, self.rope_dim)], dim=-1)  # (B, S, H, d_n+d_r)
        return k.transpose(1, 2), v.transpose(1, 2)

    def queries(self, q_in: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The query up-projection: q_in (B, T, d_q) latent (or (B, T, C)) -> q (B, H, T, d_n+d_r) with
        RoPE on its d_r slice. A method so activation checkpointing can recompute it."""
        b, t, _ = q_in.shape
        q = self.wq_b(q_in) if hasattr(self, "wq_a") else self.wq(q_in)  # (B, T, H*(d_n+d_r))
        q = q.view(b, t, -1, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)  # (B, T, H, d_n), (B, T, H, d_r)
        return torch.cat([q_nope, apply_rope(q_rope, cos, sin)], dim=-1).transpose(1, 2)

    def attend(self, q_in: torch.Tensor, c_kv: torch.Tensor, k_rope: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """Up-projections and attention from the latents: q_in (B, T, d_q), c_kv (B, T, d_c) normalised,
        k_rope (B, T, d_r) rotated -> (B, H, T, d_v). One method, so activation checkpointing
        (``deepseek``) can keep just the latents and recompute the per-head q, k, v."""
        q = self.queries(q_in, cos, sin)  # (B, H, T, d_n+d_r)
        k, v = self.expand_kv(c_kv, k_rope)
        return self.core(q, k, v) if documents is None else self.core(q, k, v, documents=documents)

    def enter_heads(self, x: torch.Tensor) -> torch.Tensor:
        """Identity on one device; tp installs Megatron's f here (``tp.plan``), so the down-projections
        run before the head split. x (B, T, d_q + d_c + d_r) -> same (sp: (B, T/tp, .) -> (B, T, .))."""
        return x

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCacheLike | None = None, documents: torch.Tensor | None = None) -> torch.Tensor:
        latent = hasattr(self, "wq_a")
        q_in = self.q_norm(self.wq_a(x)) if latent else x  # (B, T, d_q) or (B, T, C)
        c_kv, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope_dim], dim=-1)  # (B, T, d_c), (B, T, d_r)
        # one f for the query input and the kv latent: (B, T, d_q | C) + (B, T, d_c + d_r)
        qkv = self.enter_heads(torch.cat([q_in, self.kv_norm(c_kv), k_rope], dim=-1))
        q_in, c_kv, k_rope = qkv.split([q_in.shape[-1], self.kv_rank, self.rope_dim], dim=-1)
        b, t, _ = qkv.shape
        k_rope = apply_rope(k_rope.unsqueeze(2), cos, sin).squeeze(2)  # (B, T, d_r)
        if kv_cache is None:
            out = self.attend(q_in, c_kv, k_rope, cos, sin, documents)
        else:
            q = self.queries(q_in, cos, sin)  # (B, H, T, d_n+d_r)
            past = kv_cache.length
            c_all, r_all = kv_cache.update(self.layer_id, c_kv.unsqueeze(1), k_rope.unsqueeze(1))  # (B, 1, S, .)
            k, v = self.expand_kv(c_all.squeeze(1), r_all.squeeze(1))
            out = causal_attention(q, k, v, q_offset=past)  # (B, H, T, d_v)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))  # (B, T, H*d_v) -> (B, T, C)
