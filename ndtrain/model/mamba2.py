"""Mamba-2 token mixer (Dao & Gu 2024, "Transformers are SSMs"), with ``mamba_groups`` B / C groups,
parameters as HF's ``Mamba2Mixer`` (``ndtrain.hf.mamba2`` maps them 1:1):

    [z, xBC, dt] = in_proj(u);  xBC = silu(conv1d(xBC));  [x, B, C] = xBC
    dt = softplus(dt + dt_bias);  A = -exp(A_log)                       (one scalar per head)
    h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t^T;  y_t = h_t^T C_t + D x_t  (h: N x P per head)
    out = out_proj(GroupRMSNorm(y * silu(z)))

SSD is decayed linear attention with q = C, k = B, v = dt x, log-decay dt A (``ops.linear_attn``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ndtrain.mixer_spec import linear_dims
from ndtrain.model.mixer_common import (
    GatedRMSNorm,
    causal_conv,
    conv_context,
    document_context,
    get_state,
    identity_conv_,
    make_conv,
    scan_linear,
    ssm_decay_init_,
)


class GroupGatedRMSNorm(GatedRMSNorm):
    """``RMSNorm(x * silu(z))`` with the mean square per each of ``groups`` slices (HF
    ``MambaRMSNormGated(group_size=C / groups)``). Shapes (..., C)."""

    def __init__(self, dim: int, eps: float, groups: int):
        super().__init__(dim, eps, gate_first=True)
        self.groups = groups

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if self.groups == 1:
            return super().forward(x, gate)
        xf = x.float() * F.silu(gate.float())  # (..., C) fp32
        xg = xf.view(*xf.shape[:-1], self.groups, -1)  # (..., g, C/g)
        xg = xg * torch.rsqrt(xg.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xg.view_as(xf).to(x.dtype)


def per_head(m: torch.Tensor, n_heads: int, n_state: int) -> torch.Tensor:
    """B or C (B, T, g*N) -> (B, n_h, T, N), head h reading group h // (n_h / g) (HF's order)."""
    b, t, gn = m.shape
    g = gn // n_state
    if g == 1:
        return m[:, None].expand(b, n_heads, t, n_state)
    m = m.view(b, t, g, 1, n_state).expand(b, t, g, n_heads // g, n_state)
    return m.reshape(b, t, n_heads, n_state).transpose(1, 2)


class Mamba2(nn.Module):
    """x (B, T, C) -> (B, T, C); cos / sin ignored. Inner width ``mamba_expand * dim`` = n_h * P
    (``mamba_head_dim``), state N (``mamba_state_dim``), conv width ``linear_conv_kernel``."""

    ndtrain_normal_init = True  # A_log / dt_bias / D get a placeholder draw, then init_buffers
    state_passer = None  # context parallel's hook (mixer_common.StatePasser); None: whole sequence

    def __init__(self, cfg, layer_id: str = "0"):
        super().__init__()
        x = linear_dims(cfg)
        self.layer_id, self.chunk_size = layer_id, cfg.linear_chunk_size
        self.d_inner, self.n_state, self.n_heads, self.head_dim = x["d_inner"], x["m_state"], x["m_heads"], x["m_head_dim"]
        self.n_groups = x["m_groups"]
        gn = self.n_groups * self.n_state  # B (and C) width
        conv_ch = self.d_inner + 2 * gn
        self.in_proj = nn.Linear(cfg.dim, 2 * self.d_inner + 2 * gn + self.n_heads, bias=False)
        self.conv1d = make_conv(conv_ch, x["conv"], bias=True)
        self.dt_bias = nn.Parameter(torch.empty(self.n_heads))  # (n_h,)
        self.A_log = nn.Parameter(torch.empty(self.n_heads))  # (n_h,)
        self.D = nn.Parameter(torch.empty(self.n_heads))  # (n_h,) skip connection
        self.norm = GroupGatedRMSNorm(self.d_inner, cfg.norm_eps, self.n_groups)
        self.out_proj = nn.Linear(self.d_inner, cfg.dim, bias=False)

    @torch.no_grad()
    def init_buffers(self) -> None:
        """SSM parameters after the generic init: A in [1, 16], dt in [1e-3, 0.1], D = 1, identity conv."""
        ssm_decay_init_(self.A_log, self.dt_bias)
        from ndtrain.model.init import _copy_full_

        _copy_full_(self.D, torch.ones(self.n_heads))
        identity_conv_(self.conv1d)

    def forward(self, u: torch.Tensor, cos=None, sin=None, kv_cache=None, documents=None) -> torch.Tensor:
        b, t, _ = u.shape
        di, n, nh, p = self.d_inner, self.n_state, self.n_heads, self.head_dim
        gn = self.n_groups * n
        z, xbc, dt = self.in_proj(u).split([di, di + 2 * gn, nh], dim=-1)  # (B, T, *)
        st, passer = get_state(kv_cache, self.layer_id), (self.state_passer if kv_cache is None else None)
        prev_docs, resets = document_context(passer, documents, self.conv1d.weight.shape[-1])
        xbc, conv_state = causal_conv(xbc, self.conv1d, conv_context(passer, xbc, self.conv1d, st.get("conv")),
                                      documents, prev_docs)
        x, bm, cm = F.silu(xbc).split([di, gn, gn], dim=-1)  # (B, T, di), (B, T, gN), (B, T, gN)
        sdt = torch.float64 if u.dtype == torch.float64 else torch.float32  # the state's dtype
        dt = F.softplus(dt.to(sdt) + self.dt_bias.to(sdt))  # (B, T, n_h)
        log_decay = (dt * -self.A_log.to(sdt).exp()).transpose(1, 2)  # (B, n_h, T)
        xh = x.view(b, t, nh, p)  # (B, T, n_h, P)
        v = (xh.to(sdt) * dt[..., None]).to(x.dtype).transpose(1, 2)  # (B, n_h, T, P)
        q, k = per_head(cm, nh, n), per_head(bm, nh, n)  # (B, n_h, T, N): a group's heads share C, B
        y, ssm = scan_linear(passer, q, k, v, log_decay, st.get("ssm"), self.chunk_size, resets)  # (B, n_h, T, P)
        if kv_cache is not None:
            kv_cache.states[self.layer_id] = {"conv": conv_state, "ssm": ssm}
        y = y.transpose(1, 2) + xh * self.D.to(x.dtype)[:, None]  # (B, T, n_h, P)
        y = self.norm(y.reshape(b, t, di), z)  # (B, T, di)
        return self.out_proj(y)  # (B, T, C)
