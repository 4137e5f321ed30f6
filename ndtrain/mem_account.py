"""Per-rank memory accounting without an allocator: model-state bytes and peak activation bytes.

``StateMemory`` counts the storages a rank holds (each once; a freed FSDP parameter has size 0) in
``params`` (compute-dtype params, or ZeRO-3's shards), ``grads`` (unreduced, shards, ``.grad``),
``optim`` (Adam state, ZeRO-1/2's separate masters) and ``buffers`` (comm buffers, gathered ZeRO-3
units), sampled at fixed points of a step and, with a ``MemorySampler`` attached, inside the
sharded wrappers' hooks.

``ActivationMeter`` is a ``TorchDispatchMode`` that follows the lifetime of every storage an
operator creates (``weakref.finalize``; views alias their input) and records the peak alive: saved,
recomputed and gradient activations, on CPU and GPU alike. Excluded: storages made while
``AccumulateGrad`` runs or that become a ``.grad``, and anything inside ``untracked()``."""
from __future__ import annotations

import contextlib
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

CATEGORIES = ("params", "grads", "optim", "buffers")


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None entries skipped)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        # a fake tensor (the rehearsal) has no data pointer: its storage object is the identity
        key = (st._cdata if isinstance(t, FakeTensor) else st.data_ptr(), t.device)
        if st.nbytes() and key not in seen:
            seen.add(key)
            total += st.nbytes()
    return total


def state_tensors(model: torch.nn.Module, optimizer, dp=None) -> dict[str, list[torch.Tensor]]:
    """``dp.memory_tensors()``, or (plain DDP) the model's params / grads and the optimizer state."""
    if dp is not None and hasattr(dp, "memory_tensors"):
        return dp.memory_tensors()
    params = list(model.parameters())
    optim = [t for st in optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    return {"params": params, "grads": [p.grad for p in params], "optim": optim, "buffers": []}


class StateMemory:
    """Peak bytes per category since the last ``reset``, sampled with ``sample(tensors_by_cat)``."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.peak = dict.fromkeys(CATEGORIES, 0)
        self.peak_state = 0

    def sample(self, tensors: dict[str, list[torch.Tensor]]) -> dict[str, int]:
        now = {c: storage_bytes(tensors.get(c, [])) for c in CATEGORIES}
        for c in CATEGORIES:
            self.peak[c] = max(self.peak[c], now[c])
        self.peak_state = max(self.peak_state, now["params"] + now["grads"] + now["optim"])
        return now

    def report(self) -> dict[str, int]:
        out = {f"mem_{c}_bytes": self.peak[c] for c in CATEGORIES}
        out["mem_state_peak_bytes"] = self.peak_state
        return out


class MemorySampler:
    """Observer sampling ``dp.memory_tensors()`` into ``mem`` on every ``on_state``. Attach:
    ``dp.observers["memory"] = MemorySampler(mem)``."""

    def __init__(self, mem: StateMemory):
        self.mem = mem

    def on_state(self, dp) -> None:
        self.mem.sample(dp.memory_tensors())


_UNTRACKED = [0]


@contextlib.contextmanager
def untracked():
    """Tensors created inside are not activations (data-parallel buffers); nestable."""
    _UNTRACKED[0] += 1
    try:
        yield
    finally:
        _UNTRACKED[0] -= 1


class ActivationMeter(TorchDispatchMode):
    """Peak bytes of live activation storages while active (``m.peak``); storages becoming a ``.grad``
    of ``params`` are excluded. ``with ActivationMeter(model.parameters()) as m: loss.backward()``."""

    def __init__(self, params):
        super().__init__()
        self.params = [p for p in params if p.requires_grad]
        self.live: dict[int, int] = {}  # storage key -> bytes (tracked, alive)
        self.current = 0
        self.peak = 0
        self._hooks = []

    def __enter__(self):
        self._hooks = [p.register_post_accumulate_grad_hook(self._exclude_grad) for p in self.params]
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        return super().__exit__(*exc)

    def _exclude_grad(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self._forget(_skey(p.grad))

    def _forget(self, key) -> None:
        nbytes = self.live.pop(key, None)
        if nbytes is not None:
            self.current -= nbytes

    def _track(self, t: torch.Tensor) -> None:
        key = _skey(t)
        if key in self.live:
            return
        st = t.untyped_storage()
        nbytes = st.nbytes()
        if nbytes == 0:
            return
        self.live[key] = nbytes
        self.current += nbytes
        weakref.finalize(st, self._forget, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _UNTRACKED[0] == 0:
            node = torch._C._current_autograd_node()
            if node is None or "AccumulateGrad" not in node.name():
                # only storages the op allocated: views / in-place results alias an input
                seen = {_skey(a) for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor) and _skey(t) not in seen:
                        self._track(t)
                self.peak = max(self.peak, self.current)
        return out


def _skey(t: torch.Tensor) -> tuple[int, str]:
    return (t.untyped_storage().data_ptr(), str(t.device))
