"""Context parallel for a bounded left context (contiguous layout): the previous rank's last tokens.

* Sliding-window attention (window w; Beltagy 2020, Mistral / Gemma 3): with T/cp >= w - 1 every
  visible key is on this rank or its predecessor: 2 (w - 1) B G D s bytes per layer each way.
* The linear mixers' short convolutions (width W): (W - 1) B Ch s bytes each way.

Rank 0 receives zeros (the sequence start)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ndtrain.mesh import AxisGroup
from ndtrain.model.sliding_window import window_attention
from ndtrain.parallel.comm import count, nbytes
from ndtrain.parallel.flight_recorder import run_batch_p2p

_TAG = 29  # p2p tag of the neighbour exchange (ring attention uses its own)


def _shift(x: torch.Tensor, group: AxisGroup, step: int) -> torch.Tensor:
    """Send ``x`` to rank + step, receive from rank - step (zeros where none); bytes sent are counted."""
    r, n = group.rank, group.size
    dst, src = r + step, r - step
    x = x.contiguous()
    recv = torch.zeros_like(x)
    ops = []
    if 0 <= dst < n:
        ops.append(dist.P2POp(dist.isend, x, group=group.pg, tag=_TAG, group_peer=dst))
        count(group, nbytes(x))
    if 0 <= src < n:
        ops.append(dist.P2POp(dist.irecv, recv, group=group.pg, tag=_TAG, group_peer=src))
    if ops:
        run_batch_p2p("shift_from_prev", group, nbytes(x) if 0 <= dst < n else 0,
                      lambda: dist.batch_isend_irecv(ops), peer=src if 0 <= src < n else None).wait()
    return recv


class ShiftFromPrev(torch.autograd.Function):
    """The previous cp rank's ``x`` (zeros on rank 0), same shape. bwd sends the gradient back. Bytes:
    |x| per rank except the last (fwd) / first (bwd)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
        ctx.group = group
        return _shift(x, group, 1)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _shift(g, ctx.group, -1), None


def shift_from_prev(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """``ShiftFromPrev``, the identity's zero twin on a size-1 group (nothing before rank 0)."""
    if group.pg is None:
        return torch.zeros_like(x)
    return ShiftFromPrev.apply(x, group)


def prev_documents(documents: torch.Tensor, n: int, group: AxisGroup) -> torch.Tensor:
    """(B, T) this rank's document ids -> (B, n) the previous rank's last n (-1 on rank 0: no
    document precedes the sequence). No gradient; n B int64 bytes each way."""
    tail = documents[:, documents.shape[1] - n:].to(torch.int64)
    if group.pg is None:
        return torch.full_like(tail, -1)
    got = _shift(tail, group, 1)
    return got if group.rank else torch.full_like(tail, -1)


class WindowContextParallel(nn.Module):
    """``SlidingWindowAttention.core`` replacement: q (B, H, T/cp, D), k / v (B, G, T/cp, D) ->
    (B, H, T/cp, D), also attending to the previous rank's last ``window - 1`` keys. Raises
    ValueError when a rank holds fewer than ``window - 1`` tokens. No parameters."""

    def __init__(self, group: AxisGroup, window: int):
        super().__init__()
        self.group, self.window = group, window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        n = self.window - 1
        if n == 0:  # a window of one key: the token itself
            return window_attention(q, k, v, self.window)
        if k.shape[2] < n:
            raise ValueError(f"sliding window under context parallel: a cp rank holds {k.shape[2]} "
                             f"tokens, fewer than the window's {n} of context (swa_window - 1)")
        tail = torch.stack([k[:, :, -n:], v[:, :, -n:]])  # (2, B, G, w-1, D)
        prev = shift_from_prev(tail, self.group)
        prev_docs = None if documents is None else prev_documents(documents, n, self.group)  # (B, w-1)
        return window_attention(q, k, v, self.window, kv_prev=prev, prev_len=n if self.group.rank else 0,
                                documents=documents, prev_documents=prev_docs)

    def extra_repr(self) -> str:
        return f"cp={self.group.size}, window={self.window}, K/V: last {self.window - 1} from the previous rank"
