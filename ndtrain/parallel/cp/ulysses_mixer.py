"""Ulysses context parallel for the linear-family sequence ops: the baseline ``state_passing`` is
measured against (``bench/cp_state_passing.py``).

DeepSpeed-Ulysses (Jacobs et al. 2023): all-to-all from (T/cp tokens, H heads) to (T, H/cp), the
chunked op on whole sequences, one all-to-all back (as Megatron-Core's cp of Gated DeltaNet).
Bytes per layer, microbatch and rank, forward (backward the same): (cp-1)/cp B (T/cp) H
(2 K + 2 V + n_gates) s, linear in T. Needs H % cp == 0. The short convolutions need the previous
rank's last W-1 inputs either way (``window.shift_from_prev``)."""
from __future__ import annotations

from collections.abc import Callable

import torch

from ndtrain.mesh import AxisGroup
from ndtrain.parallel.cp.collectives import AllToAll
from ndtrain.parallel.cp.rules import check_heads

HEAD_DIM, SEQ_DIM = 1, 2  # every op input is (B, H, T, ...): per-token gates (B, H, T) too


def ulysses_scan(op: Callable[..., tuple[torch.Tensor, torch.Tensor]], group: AxisGroup,
                 q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 *gates: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``op(q, k, v, *gates, None)`` over the whole sequence with the heads split over ``group``.

    q, k (B, H, Tl, K), v (B, H, Tl, V), ``gates`` (B, H, Tl) or None, Tl = T / cp contiguous tokens;
    ``op`` has the ``chunk_linear_attn`` / ``chunk_gated_delta`` contract. Returns o (B, H, Tl, V) and
    the final state (B, H/cp, K, V) of this rank's heads. Raises ConfigError when H % cp != 0."""
    check_heads(q.shape[HEAD_DIM], group.size)

    def to_heads(x):  # (B, H, Tl, ...) -> (B, H/cp, T, ...)
        return None if x is None else AllToAll.apply(x.contiguous(), group, HEAD_DIM, SEQ_DIM)

    o, state = op(*(to_heads(x) for x in (q, k, v, *gates)), None)  # (B, H/cp, T, V)
    return AllToAll.apply(o.contiguous(), group, SEQ_DIM, HEAD_DIM), state  # (B, H, Tl, V)


def ulysses_bytes(b: int, t: int, h: int, dk: int, dv: int, n_gates: int, cp: int, elem_bytes: int) -> float:
    """Bytes one rank sends in ``ulysses_scan``'s forward (backward the same): (cp-1)/cp of q, k, v, gates,
    o."""
    return (cp - 1) / cp * b * (t // cp) * h * (2 * dk + 2 * dv + n_gates) * elem_bytes


def state_passing_bytes(b: int, h: int, dk: int, dv: int, cp: int, elem_bytes: int, delta: bool) -> float:
    """Bytes one rank sends in ``StatePasser.scan``'s forward (backward the same): (cp-1) x the packed
    state, (K V + 1) per head (scalar decay) or K (K + V) (delta rule)."""
    per_head = dk * (dk + dv) if delta else dk * dv + 1
    return (cp - 1) * b * h * per_head * elem_bytes
