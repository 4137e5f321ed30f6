"""1F1B as it is taught: a plain-function reference executor (the runtime's slow twin).

PipeDream-Flush (Narayanan et al. 2021), p stages, m microbatches, rank r, v = 1: warm-up
``w = min(p - r - 1, m)`` forwards; ``m - w`` rounds of one forward and one backward; the ``w``
backwards left. Every message is blocking; each steady-state exchange posts its send before its
receive (``_exchange``), since stage r sends an output while r+1 sends a gradient and two
blocking sends would deadlock (``simulate(..., rendezvous=True)`` shows it). ``PipelineRuntime``
with "1f1b" must match it (tests/parallel/test_pp_reference.py)."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ndtrain.mesh import AxisGroup
from ndtrain.parallel.pp.p2p import recv_tensor, send_tensor, tag


def run_1f1b(chunk: nn.Module, group: AxisGroup, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
             inputs: torch.Tensor, labels: torch.Tensor, m: int, denom: float = 1.0) -> list[torch.Tensor]:
    """One 1F1B training step of ``chunk`` over the ``pp`` group. inputs, labels: (B_local, T), cut with
    ``tensor_split``; the last stage backpropagates ``loss_fn(logits, labels_mb) / denom``. Gradients
    accumulate in ``.grad`` (no dp sync). Returns per-microbatch loss sums (float64 0-d) on the last
    stage, [] elsewhere."""
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
