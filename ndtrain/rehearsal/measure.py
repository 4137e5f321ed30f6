"""One measured training step of a built trainer, the same instruments on a real rank and in the
fake world: peak tensor memory by category at the peak moment (PyTorch's ``MemTracker``), ndtrain's
own state accounting (``ndtrain.mem_account``), and every collective this rank issued, per mesh
axis: count and op kinds (the flight recorder) and bytes sent (the mesh's counters, ``comm``).

``measure_step`` runs ``warmup`` steps first, so the measured step holds the optimizer state Adam
creates in its first step, as every step of a long run does."""
from __future__ import annotations

import contextlib
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

from ndtrain.mem_account import state_tensors
from ndtrain.parallel import flight_recorder
from ndtrain.rehearsal.ops import DEVICE, OpRecorder

# MemTracker's categories -> the names the report uses
CATEGORIES = {"Parameter": "parameters", "Gradient": "gradients", "Optstate": "optimizer_state",
              "Activation": "activations", "Temp": "temporaries", "Buffer": "buffers", "Other": "other"}
RECORD_ALL = 10**7  # flight-recorder entries kept: every collective of a step


class _NoHook:
    def remove(self) -> None:
        pass


@contextlib.contextmanager
def _input_hooks_any():
    """ModTracker's backward hook on each module's inputs (it marks the module's backward done)
    registered in ``register_multi_grad_hook``'s "any" mode, not "all". In "all" mode the hook's
    closure holds the inputs' autograd nodes while those nodes hold the hook: a cycle through C++
    that ``gc.collect()`` does not break, through which every finished backward leaves its inputs
    and their gradients alive, counted as live memory to the end of the step (a rehearsed Llama 3
    405B interleaved stage read 46 GiB where the planner's accounting of the trainer gives 18).
    "any" keeps no node; only the per-module attribution, which the rehearsal does not report,
    moves to the first input gradient."""
    from torch.distributed._tools import mod_tracker

    orig = mod_tracker.register_multi_grad_hook

    def any_mode(tensors, fn, mode="all"):
        return orig(tensors, fn, mode="any")
    mod_tracker.register_multi_grad_hook = any_mode
    try:
        yield
    finally:
        mod_tracker.register_multi_grad_hook = orig


@contextlib.contextmanager
def _taken_messages_counted(mt):
    """Each pipeline message a stage takes (``pp.p2p.Receiver.take``) counted as an activation.
    A receiver thread allocates the buffer outside the main thread's dispatch modes, so MemTracker
    never sees it made; "all"-mode ModTracker hooks had counted it only by touching it. The same on
    a real rank (gloo threads) and in the fake world (``fake._inline_receiver``)."""
    from torch.distributed._tools.mem_tracker import _MemRefType

    from ndtrain.parallel.pp import runtime

    base = runtime.Receiver

    class Counted(base):
        def take(self, key):
            t = super().take(key)
            mt._update_and_maybe_create_winfos(t, _MemRefType.ACT)  # no public API names a category
            return t
    runtime.Receiver = Counted
    try:
        yield
    finally:
        runtime.Receiver = base


def _tracker(trainer):
    """A ``MemTracker`` that knows the trainer's model, optimizer and ndtrain's own state tensors
    (ZeRO / FSDP shards and flat buffers are not module parameters): each by its category."""
    from torch._guards import active_fake_mode
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType
    from torch.distributed.tensor import DTensor

    class StepTracker(MemTracker):
        """Allows a root module's forward once per microbatch (MemTracker refuses a second call of
        a root module, taking it for the next iteration); its per-module stats restart then;
        per-module peaks are not kept (``_update_peak_stats``). A
        parameter that is not a leaf (a tensor-parallel view) gets no gradient hooks: autograd
        refuses them, and its gradient flows to the leaf it views."""

        def _update_peak_stats(self, peak_state) -> None:
            """The global peak only: MemTracker's per-module peaks copy the snapshot of every
            enclosing module at each new peak (most operators of a forward), the rehearsal's
            bottleneck at full size, and are not reported."""
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(snap)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            """``prim.device`` (most operators of a fake step: C++ asking a fake tensor its device)
            without the tree walk of its output, a device, which holds no storage; the peak check
            and the DTensor hand-off as ``MemTracker``'s."""
            if func is not DEVICE or not OpRecorder.fast_device or any(t == DTensor for t in types):
                return super().__torch_dispatch__(func, types, args, kwargs)
            res = func(*args, **(kwargs or {}))
            if active_fake_mode() is self._fake_mode_on_entry:
                self._update_peak_stats(None)
            return res

        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            for prm in module.parameters():
                if not prm.is_leaf and self._param_to_grad_hook_handles.get(prm) is None:
                    self._param_to_grad_hook_handles[prm] = (_NoHook(), _NoHook())
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

        def _pre_fw_hook(self, module, inputs):
            name = self._mod_tracker.get_known_fqn(module)
            root = set(self._mod_tracker.parents) - {name} == {"Global"}
            if module in self.memory_tracking and root and not self._mod_tracker.is_bw:
                del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)

    mt = StepTracker()
    mt.track_external(trainer.model, trainer.optimizer)
    kinds = {"params": _MemRefType.PARAM, "grads": _MemRefType.GRAD, "optim": _MemRefType.OPT}
    for cat, tensors in state_tensors(trainer.model, trainer.optimizer, trainer.dp).items():
        for t in tensors:
            if t is not None and cat in kinds:
                mt._update_and_maybe_create_winfos(t, kinds[cat])  # no public API names a category
    return mt


class WeightCopies(TorchDispatchMode):
    """Counts the low-precision copies of parameters the forward saves for backward (autocast casts
    each fp32 weight at each use, and the GEMM's backward keeps the cast): a saved tensor made by a
    dtype cast (``_to_copy``) of a parameter's storage, or a view of one. ``bytes``: their storage
    bytes per save, summed over the step's forwards (each microbatch saves its own); the
    activation category holds them. Saved-tensor hooks do not nest: a region with its own
    (``torch.utils.checkpoint``) is not seen, and keeps no copies either."""

    def __init__(self, model):
        super().__init__()
        self.params = {p.untyped_storage()._cdata for p in model.parameters()}
        self.copies = WeakTensorKeyDictionary()
        self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is DEVICE and OpRecorder.fast_device:  # most operators of a fake step; never a cast
            return out
        if func._overloadpacket is torch.ops.aten._to_copy and isinstance(args[0], torch.Tensor) \
                and args[0].untyped_storage()._cdata in self.params and isinstance(out, torch.Tensor):
            self.copies[out] = True
        return out

    def _pack(self, t):
        """Counts ``t`` if it is a weight copy; packs it detached: a saved *output* packed as itself
        would hold its own node (node -> t -> grad_fn -> node), a cycle through C++ that only
        freeing the saved variables breaks, which ``backward()`` does and the zero-bubble passes
        (``autograd.grad(retain_graph=True)``) never do, so every microbatch's graph stayed alive
        and was counted to the end of the step."""
        if isinstance(t, torch.Tensor) and (t in self.copies or (t._base is not None and t._base in self.copies)):
            self.bytes += t.untyped_storage().nbytes()
        return t.detach() if isinstance(t, torch.Tensor) else t

    def __enter__(self):
        self._hooks.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        return self._hooks.__exit__(*exc)


def collectives(entries) -> dict[str, dict[str, int]]:
    """Flight-recorder entries -> {axis: {op: count}}; a p2p's peer / tag dropped from its op name."""
    out: dict[str, dict[str, int]] = {}
    for e in entries:
        op = e["op"].split("(", 1)[0]
        ops = out.setdefault(e["axis"], {})
        ops[op] = ops.get(op, 0) + 1
    return out


def measure_step(trainer, inputs: torch.Tensor, labels: torch.Tensor, warmup: int = 1,
                 before_step=None) -> dict:
    """``warmup`` unmeasured steps, then one measured ``trainer.step(inputs, labels)``.

    ``before_step()`` runs before every step (the fake world queues its host reads there).
    Returns ``memory_peak`` {category: bytes at the peak moment, "total"}, ``ndtrain_state``
    (the step's ``mem_*`` figures), ``axis_bytes`` {axis: bytes sent}, ``collectives``
    {axis: {op: count}}, ``step_s`` (wall seconds of the measured step) and ``ops`` (the step's
    operators by shape, ``ops.OpRecorder.rows``) and ``saved_weight_copy_bytes`` (``WeightCopies``)."""
    p = trainer.cfg.parallel
    for _ in range(warmup):
        if before_step:
            before_step()
        trainer.step(inputs, labels)
    rec = flight_recorder.configure(p.collective_timeout_s, RECORD_ALL, None)
    trainer.mesh.reset_stats()
    mt, ops, copies = _tracker(trainer), OpRecorder(), WeightCopies(trainer.model)
    if before_step:
        before_step()
    t0 = time.perf_counter()
    with _input_hooks_any(), _taken_messages_counted(mt), mt, ops, copies:
        out = trainer.step(inputs, labels)
    step_s = time.perf_counter() - t0
    snap = mt.get_tracker_snapshot("peak")
    dev = next(iter(snap)) if snap else None
    peak = {CATEGORIES.get(k, k): int(v) for k, v in (snap[dev].items() if dev is not None else ())}
    peak["total"] = peak.pop("Total", sum(peak.values()))
    flight_recorder.configure(p.collective_timeout_s, p.flight_recorder_entries, None)
    return {"memory_peak": peak,
            "ndtrain_state": {k: v for k, v in out.items() if k.startswith("mem_")},
            "axis_bytes": dict(sorted(trainer.mesh.reset_stats().items())),
            "collectives": collectives(rec.entries), "step_s": step_s, "ops": ops.rows(),
            "saved_weight_copy_bytes": copies.bytes}
