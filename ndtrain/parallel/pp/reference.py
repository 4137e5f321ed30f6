"""The 1F1B schedule as it is taught: a plain-function reference executor (the runtime's slow twin).

PipeDream-Flush (Narayanan et al. 2021, "Memory-efficient pipeline-parallel DNN training"), for p
stages, m microbatches, this rank r (one model chunk per rank, ``v = 1``):

1. warm-up: ``w = min(p - r - 1, m)`` forwards, each receiving its input from stage r-1 and
   sending its output to stage r+1;
2. steady state, ``m - w`` rounds of one forward then one backward: forward microbatch ``w + i``,
   then exchange with stage r+1 (send that output, receive the gradient of microbatch ``i``),
   backward microbatch ``i``, then exchange with stage r-1 (send its input gradient, receive the
   input of the next forward);
3. cool-down: the ``w`` backwards left, each receiving from r+1 and sending to r-1.

Every communication is explicit and blocking: ``recv_tensor`` waits for a message, ``_send`` waits
until its message is taken. The two steady-state exchanges post their send before their receive and then
wait for both (``_exchange``): stage r sends an output while stage r+1 sends a gradient, so two
blocking sends in a row would deadlock (``simulate(..., rendezvous=True)`` shows it). There are no
action lists, receiver threads or overlap: it is slow, and it is obviously 1F1B.
``PipelineRuntime`` with the "1f1b" schedule must give the same losses and gradients
(``tests/parallel/test_pp_reference.py``).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ndtrain.mesh import AxisGroup
from ndtrain.parallel.pp.p2p import recv_tensor, send_tensor, tag


def run_1f1b(chunk: nn.Module, group: AxisGroup, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
             inputs: torch.Tensor, labels: torch.Tensor, m: int, denom: float = 1.0) -> list[torch.Tensor]:
    """One training step of 1F1B on this rank's stage ``chunk`` over the ``pp`` AxisGroup ``group``.

    inputs, labels: (B_local, T) on every rank, cut into m microbatches with ``tensor_split`` (as the
    runtime does). Stage 0 embeds the tokens; the last stage backpropagates ``loss_fn(logits,
    labels_mb) / denom``. Gradients accumulate into the parameters' ``.grad`` (no data-parallel
    sync). Returns the per-microbatch loss sums (float64 0-d) on the last stage, [] elsewhere.
    """
    p, r = group.size, group.rank
    first, last = r == 0, r == p - 1
    xs, ys = inputs.tensor_split(m), labels.tensor_split(m)
    losses: list[torch.Tensor] = []
    saved: list[tuple[torch.Tensor | None, torch.Tensor]] = []  # (stage input, output), FIFO

    def forward(j: int, x: torch.Tensor | None) -> torch.Tensor | None:
        """Forward of microbatch j; returns what goes to stage r+1 (None on the last stage)."""
        x_in = xs[j] if first else x.requires_grad_()
        out = chunk(x_in)
        if last:
            ls = loss_fn(out, ys[j])
            losses.append(ls.detach().double())
            out = ls / denom
        saved.append((None if first else x_in, out))
        return None if last else out

    def backward(j: int, g: torch.Tensor | None) -> torch.Tensor | None:
        """Backward of the oldest microbatch (j); returns its input gradient (None on stage 0)."""
        x_in, out = saved.pop(0)
        torch.autograd.backward([out], None if g is None else [g])
        return None if first else x_in.grad

    def to_next(j: int) -> tuple:  # (peer, tag) of microbatch j's activation, stage r -> r+1
        return r + 1, tag("F", j, r + 1, p)

    def to_prev(j: int) -> tuple:  # (peer, tag) of microbatch j's input gradient, stage r -> r-1
        return r - 1, tag("B", j, r - 1, p)

    w = min(p - r - 1, m)
    for j in range(w):  # warm-up
        y = forward(j, None if first else recv_tensor(group, r - 1, tag("F", j, r, p)))
        _send(group, y, *to_next(j))
    x = None if (first or w == m) else recv_tensor(group, r - 1, tag("F", w, r, p))
    for i in range(m - w):  # steady state: F(w + i), B(i)
        j = w + i
        y = forward(j, x)
        g = None if last else _exchange(group, y, *to_next(j), r + 1, tag("B", i, r, p))
        gx = backward(i, g)
        if first:
            x = None
        elif j + 1 < m:  # send the input gradient, receive the next forward's input
            x = _exchange(group, gx, *to_prev(i), r - 1, tag("F", j + 1, r, p))
        else:
            _send(group, gx, *to_prev(i))
    for i in range(m - w, m):  # cool-down (never on the last stage: w = 0 there)
        gx = backward(i, recv_tensor(group, r + 1, tag("B", i, r, p)))
        _send(group, gx, *to_prev(i))
    return losses


def _send(group: AxisGroup, t: torch.Tensor | None, dst: int, msg_tag: int) -> None:
    """Blocking send (returns once the message is delivered); nothing to send from stage 0 back."""
    if t is None or dst < 0:
        return
    works, _ = send_tensor(t, group, dst, msg_tag)
    for w in works:
        w.wait()


def _exchange(group: AxisGroup, t: torch.Tensor, dst: int, send_tag: int, src: int,
              recv_tag: int) -> torch.Tensor:
    """Send ``t`` to ``dst`` and receive from ``src`` as one blocking step (send posted first)."""
    works, _bufs = send_tensor(t, group, dst, send_tag)
    got = recv_tensor(group, src, recv_tag)
    for w in works:
        w.wait()
    return got
