"""Pipeline runtime: run one rank's schedule (``pp_schedules``) over torch.distributed point-to-point.

Per step, on every pp rank:

1. The local batch is cut into m microbatches (``tensor_split``: sizes differ by at most one, so
   any m <= local batch works). Every rank holds the tokens and labels; stage 0 embeds the
   tokens, the last stage computes the loss ``sum CE / n_valid_global`` (n_valid over all
   microbatches and data-parallel ranks), so summed gradients are the single-process gradient.
2. The rank's actions run in schedule order. ``F`` sends its output to the next virtual stage,
   ``B`` its input gradient to the previous one (``pp_p2p``: a dtype / shape header, then the
   tensor, so receivers need no shape knowledge).
3. Overlap: sends are ``isend`` and waited only two actions later (or at the end); receives are
   posted by one receiver thread per peer, in the order that peer sends (known from the schedule),
   so a message is received while this rank computes, and a rank blocks only when the input of
   its next action has not arrived. With that, any schedule order consistent with the dependency
   graph runs without deadlock under any timing (``pp_simulate.simulate`` checks consistency).
4. Data parallel: every backward that produces parameter gradients except the rank's last runs
   under ``dp.no_sync()``; ``dp.finish_grad_sync()`` follows the last one (tied embeddings and
   clipping over all stages: ``pp_train``).

Zero-bubble B / W split (Qi et al. 2023): ``F`` records the output of every module that owns
parameters; ``B`` asks autograd for the gradients of the stage input *and* of those outputs only
(so weight-gradient matmuls are skipped); ``W`` then backpropagates each recorded output's gradient
into that module's own parameters, exactly the skipped terms (one ``autograd.grad`` per module, then
one accumulation into ``.grad`` per W, so data-parallel hooks and ZeRO's end-of-backward flush fire
once per W, not once per module). Needs modules that use their parameters only in their forward.

Every action is timed (``time.time()``, comparable across local processes): ``last_events`` holds
(kind, mb, chunk, start, end) and the time spent waiting for inputs; see ``ndtrain.parallel.pp.viz``.
"""
from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable

import torch
from torch import nn

from ndtrain.mesh import AxisGroup
from ndtrain.parallel import comm
from ndtrain.parallel.pp.p2p import Receiver, send_tensor, tag
from ndtrain.parallel.pp.schedules import Action, Schedule, build_schedule, forward_only
from ndtrain.parallel.pp.simulate import Event


class PipelineRuntime:
    """Executes pipeline schedules for this rank's chunks.

    Args:
        chunks: this rank's modules, chunk c = virtual stage ``c * p + rank``; ``chunk(x)`` or
            ``chunk(x, positions)`` maps (B, T) tokens (stage 0) or (B, T, C) hidden states to
            hidden states, or to logits (B, T, V) on the last stage.
        group: the ``pp`` AxisGroup.
        schedule: "gpipe" | "1f1b" | "interleaved" | "zero_bubble"; v = len(chunks).
        loss_fn: (logits, labels) -> sum of token losses of a microbatch (a 0-d tensor).
        dp: the gradient synchroniser (``no_sync`` / ``finish_grad_sync``), or None.
        forward_ctx: factory of the context forwards run in (e.g. bf16 autocast).
        jitter_s: sleep uniform(0, jitter_s) seconds before every action (deadlock tests).
        track_memory: measure the peak bytes of live activation storages of each step (saved
            activations, activation gradients, buffers in flight; ``peak_activation_bytes``).
        timeout_s: how long a receive may wait before raising TimeoutError.
    """

    def __init__(self, chunks: list[nn.Module], group: AxisGroup, schedule: str,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], dp=None,
                 forward_ctx: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 device: torch.device | str = "cpu", jitter_s: float = 0.0, seed: int = 0,
                 track_memory: bool = False, timeout_s: float = 300.0):
        self.chunks, self.group, self.schedule_name = chunks, group, schedule
        self.loss_fn, self.dp, self.forward_ctx = loss_fn, dp, forward_ctx
        self.device = torch.device(device)
        self.p, self.rank, self.v = group.size, group.rank, len(chunks)
        self.jitter_s, self._rng = jitter_s, random.Random(seed * 1000 + group.rank)
        self.timeout_s = timeout_s
        self._schedules: dict[tuple[str, int], Schedule] = {}
        self.last_events: list[Event] = []
        self.last_wait_s = 0.0
        self.track_memory = track_memory
        self.peak_activation_bytes = 0
        self._capture: list | None = None
        self._hooks = []
        if schedule == "zero_bubble":
            for chunk in chunks:
                for mod in chunk.modules():
                    if any(True for _ in mod.parameters(recurse=False)):
                        self._hooks.append(mod.register_forward_hook(self._record_output))

    # --- schedule and messaging -----------------------------------------------------------------
    def schedule(self, m: int, name: str | None = None) -> Schedule:
        name = name or self.schedule_name
        key = (name, m)
        if key not in self._schedules:
            self._schedules[key] = (forward_only(self.p, m, self.v) if name == "forward_only"
                                    else build_schedule(name, self.p, m, self.v))
        return self._schedules[key]

    def _incoming(self, s: Schedule) -> dict[int, list]:
        """Per peer: (key, tag) of every message it sends to this rank, in its send order."""
        out: dict[int, list] = {}
        S = s.n_stages
        for q in range(self.p):
            if q == self.rank:
                continue
            for a in s.actions[q]:
                st = s.stage(q, a.chunk)
                if a.kind == "F" and st + 1 < S and s.where(st + 1)[0] == self.rank:
                    key = ("F", a.mb, st + 1)
                elif a.kind == "B" and st > 0 and s.where(st - 1)[0] == self.rank:
                    key = ("B", a.mb, st - 1)
                else:
                    continue
                out.setdefault(q, []).append((key, tag(key[0], key[1], key[2], S)))
        return out

    def _send(self, t: torch.Tensor, kind: str, mb: int, to_stage: int, s: Schedule) -> None:
        dst = s.where(to_stage)[0]
        works, bufs = send_tensor(t, self.group, dst, tag(kind, mb, to_stage, s.n_stages))
        self._sends.append((self._action_index, works, bufs))

    def _reap_sends(self, final: bool = False) -> None:
        keep = []
        for idx, works, bufs in self._sends:
            if final or idx <= self._action_index - 2:
                for w in works:
                    w.wait()
            else:
                keep.append((idx, works, bufs))
        self._sends = keep

    def _record_output(self, module, args, output) -> None:
        if self._capture is not None and isinstance(output, torch.Tensor) and output.requires_grad:
            self._capture.append((module, output))

    # --- one step -----------------------------------------------------------------------------
    def run(self, inputs: torch.Tensor, labels: torch.Tensor, m: int, denom: float = 1.0,
            positions: torch.Tensor | None = None, train: bool = True) -> torch.Tensor:
        """Run all m microbatches through the pipeline (forward and backward when ``train``).

        inputs, labels: (B_local, T) on every pp rank; m <= B_local. Returns the sum of the token
        losses over all microbatches (float64 0-d; non-zero only on the last stage). In training
        the parameters' ``.grad`` hold d(sum CE / denom) after the data-parallel sync.
        """
        if m < 1 or m > inputs.shape[0]:
            raise ValueError(f"microbatches m ({m}) must be in 1..local batch ({inputs.shape[0]})")
        s = self.schedule(m, None if train else "forward_only")
        xs, ys = inputs.tensor_split(m), labels.tensor_split(m)
        self._sends, self._action_index = [], 0
        self._state: dict[tuple[int, int], dict] = {}
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        recv = Receiver(self.group, self.device, self.timeout_s)
        for peer, keys in self._incoming(s).items():
            recv.start(peer, keys)
        acts = s.actions[self.rank]
        grad_kind = "W" if s.split_backward else "B"
        last_grad = max((i for i, a in enumerate(acts) if a.kind == grad_kind), default=-1)
        events, wait_s = [], 0.0
        mem = None
        if self.track_memory and train:  # live activation storages (ndtrain.mem_account)
            from ndtrain.mem_account import ActivationMeter

            mem = ActivationMeter([q for c in self.chunks for q in c.parameters()])
        grad_ctx = contextlib.nullcontext() if train else torch.no_grad()
        try:
            with grad_ctx, (mem or contextlib.nullcontext()):
                for i, a in enumerate(acts):
                    self._action_index = i
                    self._reap_sends()
                    if self.jitter_s:
                        time.sleep(self._rng.uniform(0.0, self.jitter_s))
                    st = s.stage(self.rank, a.chunk)
                    t_wait = time.time()
                    inp = None
                    if a.kind == "F" and st > 0:
                        inp = recv.take(("F", a.mb, st))
                    elif a.kind == "B" and st < s.n_stages - 1:
                        inp = recv.take(("B", a.mb, st))
                    t0 = time.time()
                    wait_s += t0 - t_wait
                    sync = (self.dp is None or not train or a.kind != grad_kind or i == last_grad)
                    with contextlib.nullcontext() if sync else self.dp.no_sync():
                        if a.kind == "F":
                            loss = self._forward(a, st, s, inp, xs[a.mb], ys[a.mb], denom, positions, train)
                            if loss is not None:
                                loss_sum += loss
                        elif a.kind == "B":
                            self._backward(a, st, s, inp)
                        else:
                            self._weight_grad(a)
                    events.append(Event(a.kind, a.mb, a.chunk, t0, time.time()))
                self._action_index = len(acts) + 2
                self._reap_sends(final=True)
                recv.join()
        finally:
            self._state = {}
            self._capture = None
        if mem is not None:
            self.peak_activation_bytes = mem.peak
        self.last_events, self.last_wait_s = events, wait_s
        if train and self.dp is not None:
            self.dp.finish_grad_sync()
        comm.all_reduce(loss_sum, self.group)  # only the last stage holds a non-zero sum
        return loss_sum

    def _forward(self, a: Action, st: int, s: Schedule, inp, tokens, labels, denom, positions, train):
        if st == 0:
            x = tokens
        else:
            x = inp.requires_grad_(train and inp.is_floating_point())
        chunk = self.chunks[a.chunk]
        self._capture = [] if (train and s.split_backward) else None
        with self.forward_ctx():
            out = chunk(x) if positions is None else chunk(x, positions)
        captured, self._capture = self._capture, None
        loss = None
        if st == s.n_stages - 1:
            ls = self.loss_fn(out, labels)
            loss = ls.detach().double()
            out = ls / denom
        else:
            self._send(out, "F", a.mb, st + 1, s)
        if train:
            self._state[(a.mb, a.chunk)] = {"x": x if st > 0 else None, "out": out, "captured": captured}
        return loss

    def _backward(self, a: Action, st: int, s: Schedule, grad_out) -> None:
        state = self._state[(a.mb, a.chunk)]
        out, x = state.pop("out"), state["x"]
        grads = None if grad_out is None else [grad_out]
        if not s.split_backward:
            torch.autograd.backward([out], grads)
            gx = x.grad if x is not None else None
            self._state.pop((a.mb, a.chunk))
        else:  # input gradient and the gradients at every parameter-owning module's output
            captured = state["captured"]
            targets = ([x] if x is not None else []) + [y for _, y in captured]
            got = torch.autograd.grad([out], targets, grads, retain_graph=True, allow_unused=True)
            gx = got[0] if x is not None else None
            state["wgrads"] = list(zip(captured, got[1 if x is not None else 0:]))
            state.pop("captured")
        if st > 0:
            self._send(gx, "B", a.mb, st - 1, s)

    def _weight_grad(self, a: Action) -> None:
        state = self._state.pop((a.mb, a.chunk))
        params, grads = [], {}
        for (mod, y), g in state["wgrads"]:
            if g is None:
                continue
            ps = [q for q in mod.parameters(recurse=False) if q.requires_grad]
            for q, gq in zip(ps, torch.autograd.grad([y], ps, [g], retain_graph=True, allow_unused=True)):
                if gq is None:
                    continue
                if id(q) in grads:
                    grads[id(q)] = grads[id(q)] + gq
                else:
                    params.append(q)
                    grads[id(q)] = gq
        if params:  # one backward per W: data-parallel hooks and end-of-backward flushes fire once
            torch.autograd.backward([_AccumulateInto.apply([grads[id(q)] for q in params], *params)],
                                    inputs=params)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


class _AccumulateInto(torch.autograd.Function):
    """fwd: a 0-d zero that depends on ``params`` (their data is not read; ZeRO-3 may have freed
    it), bwd: the given gradients for ``params``, which autograd accumulates into ``.grad``."""

    @staticmethod
    def forward(ctx, grads, *params):
        ctx.grads = grads
        return params[0].new_zeros(())

    @staticmethod
    def backward(ctx, _):
        return (None, *ctx.grads)
