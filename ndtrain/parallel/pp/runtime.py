"""Pipeline runtime: run one rank's schedule over point-to-point (docs/pipeline_parallel.md, "Runtime").

``run`` loops over the actions, one short method per kind. The last stage's loss is ``sum CE /
n_valid_global``, so summed gradients are the single-process gradient; every other stage
backpropagates its own MoE layers' aux terms. Every gradient-producing action but the rank's last
runs under ``dp.no_sync()``. Zero-bubble split (Qi et al. 2023): B differentiates the stage input
and the recorded owner outputs only, W the weights (``split_backward``); parameters whose owner did
not run (an MoE router's functional ``F.linear``) or that two modules own are taken directly in B.
DualPipeV pairs (``overlap``) run B in a worker thread beside F (``pairs``; bitwise the sequential
pair), sequentially when an activation meter is attached."""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ndtrain.mesh import AxisGroup
from ndtrain.parallel import comm
from ndtrain.parallel.pp.observe import ActivationMemory
from ndtrain.parallel.pp.p2p import Receiver, send_tensor, tag
from ndtrain.parallel.pp.pairs import run_pair
from ndtrain.parallel.pp.schedules import Action, Schedule, build_schedule, forward_only
from ndtrain.parallel.pp.split_backward import (
    accumulate_weight_grads,
    direct_parameters,
    parameter_owners,
    shared_parameters,
)
from ndtrain.parallel.pp.stage import release_sent_output


# Python's GIL switch interval while a step runs (the default is 5 ms). The receiver threads (``p2p``)
# and DualPipeV's B thread need the GIL for a few microseconds at each message: with the default, a
# thread woken by an arrived header waits up to 5 ms for the main thread (running a forward's Python)
# to let go, and the sending rank, whose sends complete only once the receive is posted, waits with
# it. On two 1-thread CPU ranks (``bench/step_breakdown.py``, 1F1B, m 4) one alternating pair of runs
# gave 612 -> 594 ms a step, a second pair was within the machine's spread (docs/performance.md).
SWITCH_INTERVAL_S = 2e-4


@contextlib.contextmanager
def _switch_interval(seconds: float):
    old = sys.getswitchinterval()
    sys.setswitchinterval(min(old, seconds))
    try:
        yield
    finally:
        sys.setswitchinterval(old)


@dataclass
class _Step:
    """State of one ``run``: inputs, loss settings, saved activations per (mb, chunk), sends."""

    s: Schedule
    xs: tuple
    ys: tuple
    denom: float
    positions: tuple  # per microbatch: (T,) shared, or (B_mb, T) rows; Nones without
    train: bool
    extra_loss: Callable | None
    loss_scale: float
    recv: Receiver
    local: dict = field(default_factory=dict)  # messages to this rank itself (V turn), by key
    last_grad: int = -1  # index of the rank's last gradient-producing action (synchronised)
    losses: list = field(default_factory=list)
    saved: dict = field(default_factory=dict)
    sends: list = field(default_factory=list)
    index: int = 0
    documents: tuple = ()  # per microbatch (B_mb, T) packed document ids; () without


class PipelineRuntime:
    """Executes pipeline schedules for this rank's chunks.

    Args:
        chunks: this rank's modules (chunk c = virtual stage ``c * p + rank``): (B, T) tokens on
            stage 0 or (B, T, C) hidden states in; hidden states, or logits (B, T, V) on the last stage.
        group: the ``pp`` AxisGroup (size 1: one stage, no messages).
        schedule: "gpipe" | "1f1b" | "interleaved" | "zero_bubble" | "dualpipev"; v = len(chunks).
        loss_fn: (logits, labels) -> 0-d sum of a microbatch's token losses.
        dp: the gradient synchroniser, or None.
        forward_ctx: factory of the context forwards run in (e.g. bf16 autocast).
        timeout_s: how long a receive waits before raising TimeoutError.
        overlap: run DualPipeV's F&B pairs in two threads (resolved by ``rules.resolve_overlap``).
    Attributes: ``observers`` (``observe.RuntimeObserver``s), ``microbatch_losses`` (last step's
    per-microbatch loss sums, float64 0-d, last stage only)."""

    def __init__(self, chunks: list[nn.Module], group: AxisGroup, schedule: str,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], dp=None,
                 forward_ctx: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 device: torch.device | str = "cpu", timeout_s: float = 300.0, overlap: bool = False):
        self.chunks, self.group, self.schedule_name = chunks, group, schedule
        self.loss_fn, self.dp, self.forward_ctx = loss_fn, dp, forward_ctx
        self.device = torch.device(device)
        self.p, self.rank, self.v = group.size, group.rank, len(chunks)
        self.timeout_s = timeout_s
        self.overlap = overlap
        self.observers: list = []
        self.microbatch_losses: list[torch.Tensor] = []
        self._schedules: dict[tuple[str, int], Schedule] = {}
        self._step: _Step | None = None
        self._capture: list | None = None
        self._hooks = []
        self._owners = [parameter_owners(chunk) for chunk in chunks]
        self._shared = shared_parameters(self._owners)  # tied: differentiated whole in B
        if schedule in ("zero_bubble", "dualpipev"):  # the schedules that split the backward
            unique = {id(mod): mod for owners in self._owners for mod in owners}  # one hook per module,
            self._hooks = [mod.register_forward_hook(self._record_output)  # even one two chunks share
                           for mod in unique.values()]
            for mod in unique.values():  # owners that can name their W-pass tensor: ask them to
                if hasattr(mod, "keep_weight_grad_output"):
                    mod.keep_weight_grad_output = True

    def schedule(self, m: int, name: str | None = None) -> Schedule:
        name = name or self.schedule_name
        if (name, m) not in self._schedules:
            vshape = self.schedule_name == "dualpipev"
            self._schedules[(name, m)] = (forward_only(self.p, m, self.v, vshape) if name == "forward_only"
                                          else build_schedule(name, self.p, m, self.v))
        return self._schedules[(name, m)]

    # --- the step: a loop dispatching actions --------------------------------------------------
    def run(self, inputs: torch.Tensor, labels: torch.Tensor, m: int, denom: float = 1.0,
            positions: torch.Tensor | None = None, train: bool = True,
            extra_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
            loss_scale: float = 1.0, documents: torch.Tensor | None = None) -> torch.Tensor:
        """Run all m microbatches (forward and backward when ``train``); inputs, labels: (B_local, T).

        The last stage backpropagates ``(loss_fn(logits, labels_mb) / denom + extra_loss(labels_mb)) *
        loss_scale``, the others their own ``extra_loss * loss_scale`` with the received gradient. Returns
        the summed token loss (float64 0-d, all-reduced over pp); ``.grad`` holds the synced gradients.
        ``documents`` (B_local, T) and (B_local, T) ``positions`` are split like the rows and reach every
        stage (every chunk's forward). Raises ValueError unless 1 <= m <= B_local; TimeoutError if a
        message does not arrive."""
        if m < 1 or m > inputs.shape[0]:
            raise ValueError(f"microbatches m ({m}) must be in 1..local batch ({inputs.shape[0]})")
        s = self.schedule(m, None if train else "forward_only")
        rows = positions is not None and positions.dim() == 2  # per-row positions (packed documents)
        per_mb = positions.tensor_split(m) if rows else (positions,) * m
        st = self._step = _Step(s, inputs.tensor_split(m), labels.tensor_split(m), denom, per_mb,
                                train, extra_loss, loss_scale, self._start_receiver(s),
                                documents=() if documents is None else documents.tensor_split(m))
        acts, obs = s.actions[self.rank], self.observers
        grad_kind = "W" if s.split_backward else "B"
        st.last_grad = max((i for i, a in enumerate(acts) if a.kind == grad_kind), default=-1)
        for o in obs:
            o.on_step_start(self, s, train)
        pairs = self._overlapped_pairs(s, train)
        try:
            with contextlib.nullcontext() if train else torch.no_grad(), self._switch_interval():
                i = 0
                while i < len(acts):
                    if i in pairs:  # F at i, B at i + 1: B in a worker thread beside F
                        run_pair(self, i, acts[i], acts[i + 1])
                        i += 2
                    else:
                        self._run_action(i, acts[i])
                        i += 1
                self._reap_sends(final=True)
                st.recv.join()
        finally:
            self._step, self._capture = None, None
            for o in obs:
                o.on_step_end()
        if train and self.dp is not None:
            self.dp.finish_grad_sync()
        self.microbatch_losses = st.losses
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for loss in st.losses:  # microbatch order, as a plain loop accumulates
            loss_sum += loss
        comm.all_reduce(loss_sum, self.group)  # only the last stage holds a non-zero sum
        return loss_sum

    def _switch_interval(self):
        """The step's GIL switch interval (``SWITCH_INTERVAL_S``) when there are stages to message;
        one stage has no receiver threads, and keeps the caller's."""
        return _switch_interval(SWITCH_INTERVAL_S) if self.p > 1 else contextlib.nullcontext()

    def _run_action(self, i: int, a: Action) -> None:
        """Action ``i`` of the rank's list: wait for its input, run it (observers around both)."""
        st, obs = self._step, self.observers
        st.index = i
        self._reap_sends()
        for o in obs:
            o.on_wait(a)
        inp = self._receive(a)
        for o in obs:
            o.on_action_start(a)
        with self._dp_context(i):
            {"F": self._forward, "B": self._backward, "W": self._weight_grad}[a.kind](a, inp)
        for o in obs:
            o.on_action_end(a)

    def _overlapped_pairs(self, s: Schedule, train: bool) -> set[int]:
        """Indices starting an overlapped F&B pair this step: with ``overlap``, in training, no activation
        meter, and a split backward (so B never touches ``.grad`` nor dp hooks: W does, on the main
        thread)."""
        if not (self.overlap and train and s.split_backward and s.pairs) or self.track_memory:
            return set()
        acts = s.actions[self.rank]
        return {i for i in s.pairs[self.rank] if acts[i].kind == "F" and acts[i + 1].kind == "B"}

    def _dp_context(self, i: int):
        """``dp.no_sync()`` for every gradient-producing action of the rank but its last."""
        st = self._step
        kind = st.s.actions[self.rank][i].kind
        if self.dp is None or not st.train or kind != ("W" if st.s.split_backward else "B"):
            return contextlib.nullcontext()
        return contextlib.nullcontext() if i == st.last_grad else self.dp.no_sync()

    # --- messages -------------------------------------------------------------------------------
    def _start_receiver(self, s: Schedule) -> Receiver:
        recv = Receiver(self.group, self.device, self.timeout_s)
        for peer, msgs in s.inbound(self.rank).items():
            recv.start(peer, [(msg, tag(*msg, s.n_stages)) for msg in msgs])
        return recv

    def _receive(self, a: Action) -> torch.Tensor | None:
        """The input of ``a`` from another stage (None for F on stage 0, B on the last stage, W)."""
        s = self._step.s
        stage = s.stage(self.rank, a.chunk)
        if (a.kind == "F" and stage > 0) or (a.kind == "B" and stage < s.n_stages - 1):
            key = (a.kind, a.mb, stage)
            if key in self._step.local:
                return self._step.local.pop(key)
            return self._step.recv.take(key)
        return None

    def _send(self, t: torch.Tensor, a: Action) -> None:
        msg = self._step.s.message(self.rank, a)
        if msg is not None:
            dst = self._step.s.where(msg[2])[0]
            if dst == self.rank:  # the next stage is this rank's other chunk: no message
                self._step.local[msg] = t.detach().clone()
                return
            works, bufs = send_tensor(t, self.group, dst, tag(*msg, self._step.s.n_stages))
            self._step.sends.append((self._step.index, works, bufs))

    def _reap_sends(self, final: bool = False) -> None:
        """Wait for sends posted two or more actions ago (all when ``final``), freeing buffers."""
        keep = []
        for idx, works, bufs in self._step.sends:
            if final or idx <= self._step.index - 2:
                for w in works:
                    w.wait()
            else:
                keep.append((idx, works, bufs))
        self._step.sends = keep

    def _record_output(self, module, args, output) -> None:
        """Forward hook of each parameter owner under a split schedule: record what W differentiates (the
        output, or ``weight_grad_output``: an ep layer's GEMM output before its combine). The attribute is
        cleared either way, so no activation stays alive."""
        y = output
        if getattr(module, "keep_weight_grad_output", False):
            y, module.weight_grad_output = module.weight_grad_output, None
        if self._capture is not None and isinstance(y, torch.Tensor) and y.requires_grad:
            self._capture.append((module, y))

    # --- compute actions --------------------------------------------------------------------------
    def _forward(self, a: Action, inp: torch.Tensor | None) -> None:
        st, s = self._step, self._step.s
        stage = s.stage(self.rank, a.chunk)
        x = st.xs[a.mb] if stage == 0 else inp.requires_grad_(st.train and inp.is_floating_point())
        self._capture = [] if (st.train and s.split_backward) else None
        with self.forward_ctx():
            pos, chunk = st.positions[a.mb], self.chunks[a.chunk]
            if st.documents:
                out = chunk(x, pos, documents=st.documents[a.mb])
            else:
                out = chunk(x) if pos is None else chunk(x, pos)
        captured, self._capture = self._capture, None
        extra = None
        if stage == s.n_stages - 1:
            ls = self.loss_fn(out, st.ys[a.mb])
            st.losses.append(ls.detach().double())
            out = ls / st.denom
            if st.extra_loss is not None:
                out = out + st.extra_loss(st.ys[a.mb])
            if st.loss_scale != 1.0:
                out = out * st.loss_scale
        else:
            self._send(out, a)
            extra = self._stage_extra(a)
            if st.train:  # backward needs out's node and shape only; the send keeps its own reference
                release_sent_output(out)
        if st.train:
            st.saved[(a.mb, a.chunk)] = {"x": x if stage > 0 else None, "out": out, "captured": captured,
                                         "extra": extra}

    def _stage_extra(self, a: Action) -> torch.Tensor | None:
        """A non-last stage's aux-loss term times the loss scale, or None (dense stage, eval)."""
        st = self._step
        if not st.train or st.extra_loss is None:
            return None
        t = st.extra_loss(st.ys[a.mb])
        if not (isinstance(t, torch.Tensor) and t.requires_grad):
            return None
        return t * st.loss_scale if st.loss_scale != 1.0 else t

    def _backward(self, a: Action, grad_out: torch.Tensor | None) -> None:
        self._send(self._input_grad(a, grad_out), a)

    def _input_grad(self, a: Action, grad_out: torch.Tensor | None) -> torch.Tensor | None:
        """B's autograd: the stage input's gradient (None on stage 0); split schedules keep the weight pieces
        for W. Sends nothing (an overlapped pair's B runs in a thread)."""
        st = self._step
        saved = st.saved[(a.mb, a.chunk)]
        out, x, extra = saved.pop("out"), saved["x"], saved.pop("extra")
        outs, grads = [out], (None if grad_out is None else [grad_out])
        if extra is not None:  # this stage's aux term: its gradient joins the received one
            outs, grads = [out, extra], [grad_out, None]
        if not st.s.split_backward:
            torch.autograd.backward(outs, grads)
            gx = x.grad if x is not None else None
            st.saved.pop((a.mb, a.chunk))
        else:  # input gradient and the gradients at every parameter-owning module's output
            captured = saved.pop("captured")
            direct = direct_parameters(self._owners[a.chunk], captured, self._shared)
            targets = ([x] if x is not None else []) + [y for _, y in captured] + direct
            got = torch.autograd.grad(outs, targets, grads, retain_graph=True, allow_unused=True)
            gx = got[0] if x is not None else None
            k = (1 if x is not None else 0) + len(captured)
            saved["wgrads"] = list(zip(captured, got[1 if x is not None else 0:k]))
            saved["direct"] = list(zip(direct, got[k:]))
        return gx

    def _weight_grad(self, a: Action, _inp=None) -> None:
        saved = self._step.saved.pop((a.mb, a.chunk))
        accumulate_weight_grads(saved["wgrads"], saved["direct"], skip=self._shared,
                                gather=getattr(self.dp, "gathered", None))  # ZeRO-3: re-gather

    # --- activation metering, kept for callers of the former flag (``observe.ActivationMemory``) ---
    @property
    def track_memory(self) -> bool:
        return any(isinstance(o, ActivationMemory) for o in self.observers)

    @track_memory.setter
    def track_memory(self, on: bool) -> None:
        if on and not self.track_memory:
            self.observers.append(ActivationMemory())
        elif not on:
            self.observers = [o for o in self.observers if not isinstance(o, ActivationMemory)]

    @property
    def peak_activation_bytes(self) -> int:
        """Peak live activation bytes of the last metered step (0 if never metered)."""
        return next((o.peak_bytes for o in self.observers if isinstance(o, ActivationMemory)), 0)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for owners in self._owners:  # nothing would clear weight_grad_output any more
            for mod in owners:
                if getattr(mod, "keep_weight_grad_output", False):
                    mod.keep_weight_grad_output = False

