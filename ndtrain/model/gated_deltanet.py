"""Gated DeltaNet token mixer (Yang, Kautz & Hatamizadeh 2024), laid out as ``transformers``'
``Qwen3NextGatedDeltaNet`` (same names, shapes and interleaved projection order):

    [q, k, v, z] = in_proj_qkvz(x) (grouped per key head);  [b, a] = in_proj_ba(x)
    q, k, v = silu(conv1d([q, k, v]));  q, k = l2norm(q), l2norm(k);  q = q / sqrt(K)
    beta = sigmoid(b);  g = -exp(A_log) softplus(a + dt_bias)           (per value head)
    S_t = e^(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T;  o_t = S_t^T q_t
    out = out_proj(RMSNorm(o) * silu(z))

Each key head serves H_v / H_k value heads (``ops.gated_delta``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ndtrain.mixer_spec import linear_dims
from ndtrain.model.mixer_common import (
    LINEAR_IMPL,
    GatedRMSNorm,
    causal_conv,
    conv_context,
    document_context,
    get_state,
    identity_conv_,
    make_conv,
    ssm_decay_init_,
)
from ndtrain.ops.gated_delta import chunk_gated_delta, naive_gated_delta, recurrent_gated_delta_step


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in fp32 (as Qwen3-Next's kernel does; fp64 stays fp64)."""
    xf = x if x.dtype == torch.float64 else x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def run_gated_delta(q, k, v, g, beta, state, chunk_size: int, resets=None):
    """q, k (B, H, T, K), v (B, H, T, V), g, beta (B, H, T), state | None, resets (B, T) bool document
    starts | None -> o, final state."""
    if q.shape[2] == 1 and state is not None:
        o, s = recurrent_gated_delta_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], g[:, :, 0], beta[:, :, 0], state)
        return o[:, :, None], s
    if LINEAR_IMPL["impl"] == "naive":
        return naive_gated_delta(q, k, v, g, beta, state, resets)
    return chunk_gated_delta(q, k, v, g, beta, state, chunk_size, resets)


class GatedDeltaNet(nn.Module):
    """x (B, T, C) -> (B, T, C); cos / sin ignored. Key heads H_k (``linear_heads``) of dim K, value
    heads H_v of dim V; state (B, H_v, K, V) plus the conv window (B, W-1, 2 H_k K + H_v V)."""

    ndtrain_normal_init = True  # A_log / dt_bias get a placeholder draw, then init_buffers
    state_passer = None  # context parallel's hook (mixer_common.StatePasser); None: whole sequence

    def __init__(self, cfg, layer_id: str = "0"):
        super().__init__()
        x = linear_dims(cfg)
        self.layer_id, self.chunk_size = layer_id, cfg.linear_chunk_size
        self.num_k_heads, self.head_k_dim = x["k_heads"], x["k_dim"]
        self.num_v_heads, self.head_v_dim = x["v_heads"], x["v_dim"]
        self.key_dim, self.value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        self.in_proj_qkvz = nn.Linear(cfg.dim, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(cfg.dim, 2 * self.num_v_heads, bias=False)
        self.conv1d = make_conv(2 * self.key_dim + self.value_dim, x["conv"], bias=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))  # (H_v,)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))  # (H_v,)
        # Qwen3-Next uses its rms_norm_eps here; configs without the field keep the 1e-6 of before
        self.norm = GatedRMSNorm(self.head_v_dim, getattr(cfg, "linear_norm_eps", 1e-6))
        self.out_proj = nn.Linear(self.value_dim, cfg.dim, bias=False)

    @torch.no_grad()
    def init_buffers(self) -> None:
        """A_log / dt_bias (Mamba-2's init) and an identity conv after the generic init."""
        ssm_decay_init_(self.A_log, self.dt_bias)
        identity_conv_(self.conv1d)

    def _split(self, x: torch.Tensor):
        """Qwen3-Next's grouped layout: per key head [q K | k K | v r*V | z r*V] and [b r | a r],
        r = H_v / H_k. Returns q, k (B, T, H_k*K), v, z (B, T, H_v, V), b, a (B, T, H_v)."""
        bsz, t, _ = x.shape
        hk, dk, dv, r = self.num_k_heads, self.head_k_dim, self.head_v_dim, self.num_v_heads // self.num_k_heads
        qkvz = self.in_proj_qkvz(x).view(bsz, t, hk, 2 * dk + 2 * r * dv)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)
        bb, a = self.in_proj_ba(x).view(bsz, t, hk, 2 * r).split([r, r], dim=-1)
        return (q.reshape(bsz, t, -1), k.reshape(bsz, t, -1), v.reshape(bsz, t, -1, dv),
                z.reshape(bsz, t, -1, dv), bb.reshape(bsz, t, -1), a.reshape(bsz, t, -1))

    def forward(self, x: torch.Tensor, cos=None, sin=None, kv_cache=None, documents=None) -> torch.Tensor:
        bsz, t, _ = x.shape
        q, k, v, z, bb, a = self._split(x)
        st, passer = get_state(kv_cache, self.layer_id), (self.state_passer if kv_cache is None else None)
        prev_docs, resets = document_context(passer, documents, self.conv1d.weight.shape[-1])
        qkv = torch.cat([q, k, v.flatten(2)], dim=-1)  # (B, T, 2 H_k K + H_v V)
        qkv, conv_state = causal_conv(qkv, self.conv1d, conv_context(passer, qkv, self.conv1d, st.get("conv")),
                                      documents, prev_docs)
        q, k, v = F.silu(qkv).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        r = self.num_v_heads // self.num_k_heads
        q = q.view(bsz, t, self.num_k_heads, self.head_k_dim).repeat_interleave(r, dim=2)  # (B, T, H_v, K)
        k = k.view(bsz, t, self.num_k_heads, self.head_k_dim).repeat_interleave(r, dim=2)
        q, k = l2norm(q) * self.head_k_dim ** -0.5, l2norm(k)
        v = v.view(bsz, t, self.num_v_heads, self.head_v_dim)  # (B, T, H_v, V)
        beta = bb.sigmoid().transpose(1, 2)  # (B, H_v, T)
        sdt = torch.float64 if x.dtype == torch.float64 else torch.float32
        g = (-self.A_log.to(sdt).exp() * F.softplus(a.to(sdt) + self.dt_bias.to(sdt))).transpose(1, 2)

        def run(q_, k_, v_, s_):  # the local sequence op, from state s_
            return run_gated_delta(q_, k_, v_, g, beta, s_, self.chunk_size, resets)

        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H_v, T, K|V)
        o, state = run(q, k, v, st.get("s")) if passer is None else passer.scan(run, q, k, v, delta=True, resets=resets)
        if kv_cache is not None:
            kv_cache.states[self.layer_id] = {"conv": conv_state, "s": state}
        o = self.norm(o.transpose(1, 2), z)  # (B, T, H_v, V)
        return self.out_proj(o.reshape(bsz, t, -1))  # (B, T, C)
