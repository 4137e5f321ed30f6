"""Context parallel for the linear-family mixers by state passing (contiguous layout;
docs/context_parallel.md, "Hybrid models").

Linear attention (Katharopoulos 2020), Mamba-2 (Dao & Gu 2024), Gated DeltaNet (Yang et al. 2024)
carry a state S (K x V per head); over a rank's tokens ``S_out = A_r S_in + B_r``, ``o_t = o0_t +
(A_t^T q_t)^T S_in``. Each rank runs from a zero state, all-gathers (A_j, B_j), composes
``S_in(r) = P_r`` with ``P_0 = 0, P_{j+1} = A_j P_j + B_j`` and corrects its outputs: exact, no
rank waits (``GatherStates``). The delta rule gets [A_t^T q_t | o0] and [A_r | B_r] from one run
with values [0 | v] from S' = [I | 0]. Bytes per layer and rank each way: (cp-1) B H (K V + 1) s
or (cp-1) B H K (K + V) s, independent of T."""
from __future__ import annotations

import torch
from torch import nn

from ndtrain.mesh import AxisGroup
from ndtrain.parallel import comm
from ndtrain.parallel.cp.window import prev_documents, shift_from_prev


class GatherStates(torch.autograd.Function):
    """(...) -> (cp, ...), rank order. fwd: all-gather; bwd: reduce-scatter (every later rank's
    composition used this rank's state). Bytes: (N-1)/N of the stack each way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
        ctx.group = group
        return comm.gather_dim(x[None].contiguous(), 0, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return comm.reduce_scatter_dim(g.contiguous(), 0, ctx.group)[0], None


def compose_prefix(a_all: torch.Tensor, b_all: torch.Tensor, rank: int, scalar: bool) -> torch.Tensor:
    """P_rank (B, H, K, V) from a_all (cp, B, H) log decays (``scalar``) or (cp, B, H, K, K) maps and
    b_all (cp, B, H, K, V). All prefixes are computed so every rank's graph reaches every gathered
    state (the reduce-scatter backward runs on all)."""
    prefixes = [torch.zeros_like(b_all[0])]
    for j in range(b_all.shape[0] - 1):
        p = prefixes[-1]
        carried = a_all[j].exp()[..., None, None] * p if scalar else a_all[j] @ p
        prefixes.append(carried + b_all[j])
    return torch.stack(prefixes)[rank]


class StatePasser(nn.Module):
    """The ``state_passer`` hook (protocol: ``ndtrain.model.mixer_common.StatePasser``). No parameters.

    ``conv_state(x (B, T, Ch), width)`` -> (B, width-1, Ch), the previous rank's last inputs (zeros on
    rank 0; None for width 1); raises ValueError when T < width - 1. ``scan(run, q, k, v, log_decay,
    delta, resets)`` -> (o (B, H, T, V), final state (B, H, K, V)), ``run`` the mixer's own sequence op
    (honouring ``resets`` (B, T) document starts itself). ``prev_documents(documents, n)`` -> (B, n)
    the previous rank's last document ids (-1 on rank 0)."""

    def __init__(self, group: AxisGroup):
        super().__init__()
        self.group = group

    def conv_state(self, x: torch.Tensor, width: int) -> torch.Tensor | None:
        if width <= 1:
            return None
        if x.shape[1] < width - 1:
            raise ValueError(f"context parallel: a cp rank holds {x.shape[1]} tokens, fewer than the "
                             f"short convolution's {width - 1} of context")
        return shift_from_prev(x[:, x.shape[1] - (width - 1):], self.group)

    def prev_documents(self, documents: torch.Tensor, n: int) -> torch.Tensor:
        if documents.shape[1] < n:
            raise ValueError(f"context parallel: a cp rank holds {documents.shape[1]} tokens, fewer than "
                             f"the short convolution's {n} of context")
        return prev_documents(documents, n, self.group)

    def scan(self, run, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             log_decay: torch.Tensor | None = None, delta: bool = False, resets: torch.Tensor | None = None):
        if delta:
            qa, o0, a_r, b_r = _delta_run(run, q, k, v)
        else:
            o0, b_r = run(q, k, v, None)  # b_r (B, H, K, V) in the op's compute dtype
            g = (torch.zeros(q.shape[:3], dtype=b_r.dtype, device=q.device) if log_decay is None
                 else log_decay.to(b_r.dtype).cumsum(-1))  # (B, H, T) cumulative log decay
            qa, a_r = q.to(b_r.dtype) * g.exp()[..., None], g[..., -1]  # (B, H, T, K), (B, H)
            if resets is not None:  # after a document start nothing of S_in is seen or carried
                seen = resets.cumsum(-1) > 0  # (B, T)
                qa = qa.masked_fill(seen[:, None, :, None], 0.0)
                a_r = a_r.masked_fill(seen[:, -1:], float("-inf"))
        kk, vv = b_r.shape[-2:]
        a_flat = a_r.flatten(2) if delta else a_r[..., None]  # (B, H, K K) or (B, H, 1)
        na = a_flat.shape[-1]
        stacked = GatherStates.apply(torch.cat([a_flat, b_r.flatten(2)], dim=-1), self.group)  # (cp, B, H, na + K V)
        a_all = stacked[..., :na].unflatten(-1, (kk, kk)) if delta else stacked[..., 0]  # (cp, B, H[, K, K])
        b_all = stacked[..., na:].unflatten(-1, (kk, vv))  # (cp, B, H, K, V)
        s_in = compose_prefix(a_all, b_all, self.group.rank, scalar=not delta)
        o = o0 + (qa.to(s_in.dtype) @ s_in).to(o0.dtype)  # (B, H, T, V)
        a_mat = a_r.exp()[..., None, None] * s_in if not delta else a_r @ s_in
        return o, a_mat + b_r

    def extra_repr(self) -> str:
        return f"cp={self.group.size}, layout=contiguous, states: all-gather, conv context: send/recv"


def _delta_run(run, q, k, v):
    """From S' = [I | 0] with values [0 | v]: A_t^T q_t (B, H, T, K), o0 (B, H, T, V), A_r (B, H, K, K),
    B_r (B, H, K, V)."""
    b, h, t, dk = k.shape
    eye = torch.eye(dk, dtype=v.dtype, device=v.device).expand(b, h, dk, dk)
    s0 = torch.cat([eye, v.new_zeros(b, h, dk, v.shape[-1])], dim=-1)  # (B, H, K, K + V)
    o_aug, s_aug = run(q, k, torch.cat([v.new_zeros(b, h, t, dk), v], dim=-1), s0)
    return o_aug[..., :dk], o_aug[..., dk:], s_aug[..., :dk], s_aug[..., dk:]
