"""What the token mixers share: the short causal depthwise convolution with its decode state (Mamba,
Gu & Dao 2023; Gated DeltaNet, Yang 2024), the SSM decay init, the gated RMSNorm, cache lookup and
the linear-attention dispatch. ``LINEAR_IMPL``: "chunk" (default) or "naive" (the token-by-token
recurrence, the slow twin)."""
from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ndtrain.model.documents import conv_document_mask, document_starts, masked_causal_conv
from ndtrain.model.norm import RMSNorm
from ndtrain.ops.linear_attn import chunk_linear_attn, naive_linear_attn, recurrent_linear_attn_step

LINEAR_IMPL = {"impl": "chunk"}  # "chunk" | "naive": module-wide switch used by the twin tests


def get_state(kv_cache, layer_id: str) -> dict:
    """This layer's recurrent state from a cache ({} when there is no cache or nothing cached)."""
    if kv_cache is None or kv_cache.length == 0:
        return {}
    return kv_cache.states.get(layer_id, {})


def causal_conv(x: torch.Tensor, conv: nn.Conv1d, state: torch.Tensor | None,
                documents: torch.Tensor | None = None, prev_documents: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution continuing from ``state``: x (B, T, Ch), conv ``nn.Conv1d(Ch, Ch, W,
    groups=Ch)``, state (B, W-1, Ch) or None (zeros) -> y (B, T, Ch) (no activation), new state.
    ``documents`` (B, T) ids, ``prev_documents`` (B, W-1) the state's (None: another document): taps
    reading another document's input see zero."""
    w = conv.weight.shape[-1]
    if state is None:
        state = x.new_zeros(x.shape[0], w - 1, x.shape[2])
    xp = torch.cat([state.to(x.dtype), x], dim=1)  # (B, W-1+T, Ch)
    if documents is None:
        y = F.conv1d(xp.transpose(1, 2), conv.weight, conv.bias, groups=x.shape[2]).transpose(1, 2)  # (B, T, Ch)
    else:
        y = masked_causal_conv(xp, conv.weight, conv.bias, conv_document_mask(documents, w, prev_documents))
    return y, xp[:, xp.shape[1] - (w - 1):]


def make_conv(channels: int, width: int, bias: bool) -> nn.Conv1d:
    conv = nn.Conv1d(channels, channels, width, groups=channels, bias=bias)  # weight (Ch, 1, W)
    conv.ndtrain_normal_init = True  # placeholder draw; the owner's init_buffers sets the real values
    return conv


def identity_conv_(conv: nn.Conv1d) -> None:
    """Init a depthwise conv as the identity (last tap 1, rest and bias 0): deterministic, layout-free."""
    from ndtrain.model.init import _copy_full_

    full = torch.zeros(tuple(conv.weight.shape))
    full[..., -1] = 1.0
    _copy_full_(conv.weight, full)
    if conv.bias is not None:
        _copy_full_(conv.bias, torch.zeros(tuple(conv.bias.shape)))


def ssm_decay_init_(a_log: torch.Tensor, dt_bias: torch.Tensor) -> None:
    """Mamba-2's decay init (Dao & Gu 2024): A over [1, 16], dt over [1e-3, 1e-1] log-evenly (no
    generator needed), dt_bias = softplus^-1(dt)."""
    from ndtrain.model.init import _copy_full_

    h = a_log.shape[0]
    _copy_full_(a_log, torch.linspace(1.0, 16.0, h).log())
    dt = torch.linspace(math.log(1e-3), math.log(1e-1), h).exp()
    _copy_full_(dt_bias, dt + torch.log(-torch.expm1(-dt)))


class GatedRMSNorm(RMSNorm):
    """``RMSNorm(x) * silu(gate)`` (Qwen3-Next), or with ``gate_first`` ``RMSNorm(x * silu(gate))``
    (Mamba-2). Shapes (..., C)."""

    def __init__(self, dim: int, eps: float = 1e-6, gate_first: bool = False):
        super().__init__(dim, eps)
        self.gate_first = gate_first

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if self.gate_first:
            return super().forward((x.float() * F.silu(gate.float())).to(x.dtype))
        return (super().forward(x).float() * F.silu(gate.float())).to(x.dtype)


def run_linear(q, k, v, log_decay, state, chunk_size: int, resets=None):
    """Dispatch the decayed linear-attention op: q, k (B, H, T, K), v (B, H, T, V), log_decay
    (B, H, T) | None, state (B, H, K, V) | None, resets (B, T) bool document starts | None -> o
    (B, H, T, V), final state."""
    if q.shape[2] == 1 and state is not None:
        o, s = recurrent_linear_attn_step(q[:, :, 0], k[:, :, 0], v[:, :, 0],
                                          None if log_decay is None else log_decay[:, :, 0], state)
        return o[:, :, None], s
    if LINEAR_IMPL["impl"] == "naive":
        return naive_linear_attn(q, k, v, log_decay, state, resets)
    return chunk_linear_attn(q, k, v, log_decay, state, chunk_size, resets)


class StatePasser(Protocol):
    """A linear mixer's ``state_passer`` (None: the whole sequence is here). cp installs one
    (``parallel.cp.state_passing``) that fetches the conv context and earlier tokens' state."""

    def conv_state(self, x: torch.Tensor, width: int) -> torch.Tensor | None:
        """x (B, T, Ch) this shard's conv input -> (B, width-1, Ch) the inputs just before it."""
        ...

    def scan(self, run, q, k, v, log_decay=None, delta: bool = False, resets=None):
        """``run(q, k, v, initial_state) -> (o, state)`` continued from earlier shards; ``log_decay`` (B,
        H, T), ``delta``: delta rule; ``resets`` (B, T) bool document starts (``run`` honours them too)."""
        ...

    def prev_documents(self, documents: torch.Tensor, n: int) -> torch.Tensor:
        """(B, T) this shard's document ids -> (B, n) the ids just before it (-1 where none)."""
        ...


def conv_context(passer: StatePasser | None, x: torch.Tensor, conv: nn.Conv1d, state):
    """The left context of ``causal_conv``: the cached ``state``, or the passer's when installed."""
    return state if passer is None else passer.conv_state(x, conv.weight.shape[-1])


def document_context(passer: StatePasser | None, documents, width: int):
    """(prev_documents (B, W-1) | None, resets (B, T) | None) of a linear mixer's shard: the conv's left
    context ids and the state's document starts (the first token compared with the previous shard's
    last under cp). Both None without ``documents``."""
    if documents is None:
        return None, None
    if passer is None:
        return None, document_starts(documents)
    prev = passer.prev_documents(documents, max(width - 1, 1))  # (B, n)
    return (prev if width > 1 else None), document_starts(documents, prev[:, -1])


def scan_linear(passer: StatePasser | None, q, k, v, log_decay, state, chunk_size: int, resets=None):
    """``run_linear``, continued from the earlier shards' state when a passer is installed."""
    if passer is None:
        return run_linear(q, k, v, log_decay, state, chunk_size, resets)
    return passer.scan(lambda q_, k_, v_, s_: run_linear(q_, k_, v_, log_decay, s_, chunk_size, resets),
                       q, k, v, log_decay, resets=resets)
