"""The all-to-all (Ulysses) form of context parallel for the linear-family sequence ops: the baseline
that ``state_passing`` is measured against (``bench/cp_state_passing.py``).

DeepSpeed-Ulysses (Jacobs et al. 2023) applied to a linear mixer's sequence op: every tensor that
enters the op per (head, token) is re-sharded by an all-to-all from a contiguous slice of the
sequence for all H heads to the whole sequence for H/cp heads, each rank runs the chunked op on
its heads from a zero state, and one all-to-all sends the output back. The state is per head, so
nothing else crosses ranks (the idea Megatron-Core's context parallel of Gated DeltaNet follows).

Bytes per layer and microbatch, per rank, forward (backward: the same, the inverse all-to-alls):
(cp-1)/cp * B * (T/cp) * H * (2 K + 2 V + n_gates) * s (q, k, v in, o out; n_gates = 1 per-token
decay for Mamba-2 and Gated DeltaNet plus 1 beta for the delta rule; s bytes per element). Linear
in T, against state passing's (cp-1) * B * H * (K V + 1) * s (scalar decay) or (cp-1) * B * H *
K (K + V) * s (delta rule), independent of T. Needs H % cp == 0 (a head stays on one rank).

Only the sequence op is wrapped here: the mixers' short causal convolutions need the previous
rank's last W-1 inputs in either scheme (``window.shift_from_prev``), the same bytes both ways.
"""
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

    Args: q, k (B, H, Tl, K), v (B, H, Tl, V) and ``gates`` (B, H, Tl) each (None passes through:
    linear attention has no decay), this rank's contiguous Tl = T / cp tokens; ``op`` a sequence op
    with the ``chunk_linear_attn`` / ``chunk_gated_delta`` contract, the last positional argument
    the initial state (given None: every rank holds whole sequences).
    Returns: o (B, H, Tl, V) on this rank's tokens, and the final state (B, H/cp, K, V) of this
    rank's heads after the whole sequence. Raises ConfigError (``rules.check_heads``) when H % cp != 0.
    fwd: all-to-all in (3 + gates) and out (1), bwd: their inverses (``AllToAll``).
    """
    check_heads(q.shape[HEAD_DIM], group.size)

    def to_heads(x):  # (B, H, Tl, ...) -> (B, H/cp, T, ...)
        return None if x is None else AllToAll.apply(x.contiguous(), group, HEAD_DIM, SEQ_DIM)

    o, state = op(*(to_heads(x) for x in (q, k, v, *gates)), None)  # (B, H/cp, T, V)
    return AllToAll.apply(o.contiguous(), group, SEQ_DIM, HEAD_DIM), state  # (B, H, Tl, V)


def ulysses_bytes(b: int, t: int, h: int, dk: int, dv: int, n_gates: int, cp: int, elem_bytes: int) -> float:
    """Bytes one rank sends in ``ulysses_scan``'s forward (the backward sends the same again):
    (cp-1)/cp of its q, k, v, gates and output, each (B, T/cp, H, .) of ``elem_bytes`` per element."""
    return (cp - 1) / cp * b * (t // cp) * h * (2 * dk + 2 * dv + n_gates) * elem_bytes


def state_passing_bytes(b: int, h: int, dk: int, dv: int, cp: int, elem_bytes: int, delta: bool) -> float:
    """Bytes one rank sends in ``StatePasser.scan``'s forward (the backward's reduce-scatter sends
    the same again): (cp-1) x the packed per-rank state, (K V + 1) per head for scalar decay (state
    plus log decay), K (K + V) for the delta rule (transition matrix plus state)."""
    per_head = dk * (dk + dv) if delta else dk * dv + 1
    return (cp - 1) * b * h * per_head * elem_bytes
