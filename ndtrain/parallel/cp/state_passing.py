"""Context parallel for the linear-family token mixers by state passing (contiguous layout).

Linear attention (Katharopoulos 2020), Mamba-2 / SSD (Dao & Gu 2024) and Gated DeltaNet (Yang,
Kautz & Hatamizadeh 2024) carry a fixed-size state S (K x V per head) through the sequence. Over
one cp rank's T/cp contiguous tokens the state update is an affine map of the state it starts from,

    S_out = A_r S_in + B_r,   o_t = o0_t + (A_t^T q_t)^T S_in    (A_t: the map up to token t)

with A_r = exp(sum_t g_t) I for the scalar-decay mixers (linear attention: g = 0, A = I) and
A_r = prod_t exp(g_t) (I - beta_t k_t k_t^T) for the delta rule. Every rank runs its chunked form
from a zero state (giving o0, B_r), all ranks all-gather (A_j, B_j), and each composes its true
initial state locally,

    S_in(r) = P_r,   P_0 = 0,   P_{j+1} = A_j P_j + B_j,

then adds the correction (A_t^T q_t)^T S_in to its outputs: exact (a reordering of the same
sums), fully parallel (no rank waits for its predecessor's run), one all-gather per layer forward
and one reduce-scatter of the state gradients backward (``GatherStates``).

Scalar decay: A_t^T q_t = exp(G_t) q_t with G the cumulative log decay, so only B_r (B, H, K, V) and
log A_r (B, H) travel. Delta rule: one run with the value dim augmented by K identity columns,
v' = [0 | v], S' = [I | 0], returns [A_t^T q_t | o0_t] and [A_r | B_r] together ((K + V) / V times
the work of the plain run); (B, H, K, K + V) travels.

Bytes per layer and microbatch, per rank (all-gather (cp-1)/cp of the cp-stacked states, forward;
the same again as a reduce-scatter backward): (cp - 1) * B * H * (K V + 1) * s for the scalar-decay
mixers and (cp - 1) * B * H * K (K + V) * s for Gated DeltaNet (s bytes per element: 4, or 8 in
float64); independent of T, against Ulysses' 4 (cp-1)/cp * B * (T/cp) * H * D * s each way.
The short causal convolutions take the previous rank's last W-1 inputs (``window.shift_from_prev``).
"""
from __future__ import annotations

import torch
from torch import nn

from ndtrain.mesh import AxisGroup
from ndtrain.parallel import comm
from ndtrain.parallel.cp.window import shift_from_prev


class GatherStates(torch.autograd.Function):
    """Stack every cp rank's ``x`` along a new leading dim: (...) -> (cp, ...), rank order.

    fwd: all-gather, bwd: reduce-scatter (the sum over ranks of the stack's gradient, this rank's
    slice: every later rank's composition used this rank's state). Bytes: (N-1)/N * the stack, each way.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
        ctx.group = group
        return comm.gather_dim(x[None].contiguous(), 0, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return comm.reduce_scatter_dim(g.contiguous(), 0, ctx.group)[0], None


def compose_prefix(a_all: torch.Tensor, b_all: torch.Tensor, rank: int, scalar: bool) -> torch.Tensor:
    """The initial state of cp rank ``rank``: P_rank with P_0 = 0, P_{j+1} = A_j P_j + B_j.

    a_all: (cp, B, H) log decays (``scalar``) or (cp, B, H, K, K) transition matrices; b_all
    (cp, B, H, K, V). Returns (B, H, K, V). Every rank computes all cp prefixes and picks its own,
    so each rank's graph reaches every gathered state (the reduce-scatter backward then runs on all).
    """
    prefixes = [torch.zeros_like(b_all[0])]
    for j in range(b_all.shape[0] - 1):
        p = prefixes[-1]
        carried = a_all[j].exp()[..., None, None] * p if scalar else a_all[j] @ p
        prefixes.append(carried + b_all[j])
    return torch.stack(prefixes)[rank]


class StatePasser(nn.Module):
    """The ``state_passer`` hook a linear mixer calls under context parallel (contiguous layout);
    the protocol is ``ndtrain.model.mixer_common.StatePasser``. No parameters.

    ``conv_state(x (B, T, Ch), width)`` -> (B, width-1, Ch): the previous rank's last width-1 inputs
    (zeros on rank 0), or None for width 1. Raises ValueError when T < width - 1.
    ``scan(run, q, k, v, log_decay, delta)`` -> (o (B, H, T, V), final state (B, H, K, V)) with
    ``run(q, k, v, initial_state) -> (o, state)`` the mixer's own sequence op on the local tokens.
    """

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

    def scan(self, run, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             log_decay: torch.Tensor | None = None, delta: bool = False):
        if delta:
            qa, o0, a_r, b_r = _delta_run(run, q, k, v)
        else:
            o0, b_r = run(q, k, v, None)  # b_r (B, H, K, V) in the op's compute dtype
            g = (torch.zeros(q.shape[:3], dtype=b_r.dtype, device=q.device) if log_decay is None
                 else log_decay.to(b_r.dtype).cumsum(-1))  # (B, H, T) cumulative log decay
            qa, a_r = q.to(b_r.dtype) * g.exp()[..., None], g[..., -1]  # (B, H, T, K), (B, H)
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
    """One run of the delta-rule op from S' = [I | 0] with values [0 | v]: returns A_t^T q_t
    (B, H, T, K), o0 (B, H, T, V), A_r (B, H, K, K), B_r (B, H, K, V)."""
    b, h, t, dk = k.shape
    eye = torch.eye(dk, dtype=v.dtype, device=v.device).expand(b, h, dk, dk)
    s0 = torch.cat([eye, v.new_zeros(b, h, dk, v.shape[-1])], dim=-1)  # (B, H, K, K + V)
    o_aug, s_aug = run(q, k, torch.cat([v.new_zeros(b, h, t, dk), v], dim=-1), s0)
    return o_aug[..., :dk], o_aug[..., dk:], s_aug[..., :dk], s_aug[..., dk:]
