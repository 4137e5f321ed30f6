"""Causal linear attention (Katharopoulos et al. 2020) as a token mixer: letter L of
``model.layer_pattern``."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ndtrain.model.mixer_common import document_context, get_state, scan_linear


class LinearAttention(nn.Module):
    """Causal linear attention (Katharopoulos et al. 2020, "Transformers are RNNs"):

        o_t = phi(q_t)^T S_t / (phi(q_t)^T z_t),  S_t = S_{t-1} + phi(k_t) v_t^T,  z_t = z_{t-1} + phi(k_t)

    phi = elu + 1, no positional encoding; z rides along as a value column of ones, so one state
    (B, H, D, D + 1) holds both. x (B, T, C) -> (B, T, C)."""

    state_passer = None  # context parallel's hook (mixer_common.StatePasser); None: whole sequence

    def __init__(self, cfg, layer_id: str = "0"):
        super().__init__()
        self.layer_id, self.head_dim, self.chunk_size = layer_id, cfg.head_dim, cfg.linear_chunk_size
        hd = cfg.n_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.dim, hd, bias=False)
        self.wk = nn.Linear(cfg.dim, hd, bias=False)
        self.wv = nn.Linear(cfg.dim, hd, bias=False)
        self.wo = nn.Linear(hd, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos=None, sin=None, kv_cache=None, documents=None) -> torch.Tensor:
        b, t, _ = x.shape
        d = self.head_dim
        q, k, v = (w(x).view(b, t, -1, d).transpose(1, 2) for w in (self.wq, self.wk, self.wv))  # (B, H, T, D)
        q, k = F.elu(q) + 1, F.elu(k) + 1
        v1 = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # (B, H, T, D + 1)
        passer = self.state_passer if kv_cache is None else None
        resets = document_context(passer, documents, 1)[1]
        o, state = scan_linear(passer, q, k, v1, None, get_state(kv_cache, self.layer_id).get("s"), self.chunk_size,
                               resets)
        if kv_cache is not None:
            kv_cache.states[self.layer_id] = {"s": state}
        o = o[..., :d] / (o[..., d:] + 1e-6)  # (B, H, T, D)
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))  # (B, T, C)
