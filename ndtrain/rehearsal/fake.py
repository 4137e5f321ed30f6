"""The fake world a rehearsal runs in: a process group of the full world size that moves no data
(PyTorch's ``fake`` backend) and tensors without storage (``FakeTensorMode``), so one real trainer
step of any rank of any layout runs on this CPU at full model size.

What the fake world has to answer that real data would: a host read of a tensor's value
(``.item()``, ``.tolist()``, ``float(t)``). ``HostReads`` answers each with a stand-in -- 1 / 1.0 /
True, or values queued for a read the trainer checks (``expect``) -- so the step takes the path a
healthy real step takes: the batch agreement sees equal local batches, the bad-step agreement sees
no bad rank, Adam's step counter counts. The shapes, and so the bytes, never depend on them in a
dense model; MoE routing's data-dependent shapes are answered from ``routing.Shadows`` (set as
``HostReads.shadows``).

Adaptations, all local to the fake world: ``torch._grouped_mm`` of float32 (its meta function
takes bf16 only) shaped by the bf16 meta; ``dist.all_gather_object`` (it pickles through a real
tensor) answered with this rank's object, the pipeline metric flags read as unchanged; ``nn.Module._apply`` swaps fake parameters with
``torch.utils.swap_tensors``, which refuses a tensor the fake-tensor converter's memo holds a weak
reference to, so the swap drops those memo entries first; and the bad-step agreement's flags are
read as 0.0 (no rank bad) while every other float reads 1.0."""
from __future__ import annotations

import contextlib
import functools
import threading
from collections import deque

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode

_READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default)


class HostReads(TorchDispatchMode):
    """Answers host reads: a real tensor's or a fake constant's own value; else (a fake value,
    counted in ``reads``) the next ``expect``-ed value if it is of the read's dtype, else ``fill`` (within ``as_value``)
    or 1 / 1.0 / True by dtype."""

    def __init__(self):
        super().__init__()
        self.queue: deque = deque()
        self.fill: float | None = None
        self.reads = 0
        self.shadows = None  # routing.Shadows: real twins of routing values (MoE), or None

    def expect(self, values) -> None:
        """Queue ``(dtype, value)`` pairs: the next reads of a fake tensor of that dtype, in order,
        get these values (reads of other dtypes in between, e.g. a mask's ``any()``, do not)."""
        self.queue.extend(values)

    @contextlib.contextmanager
    def as_value(self, value: float):
        old, self.fill = self.fill, value
        try:
            yield
        finally:
            self.fill = old

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
            return _grouped_mm_shape(func, args, kwargs or {})
        if func not in _READS:
            if self.shadows is not None:
                return self.shadows.dispatch(func, args, kwargs, lambda: func(*args, **(kwargs or {})))
            return func(*args, **(kwargs or {}))
        t = args[0]
        known = None if self.shadows is None else self.shadows.read(t)
        if known is not None:
            return known
        if not isinstance(t, FakeTensor) or t.constant is not None:  # a real value exists: read it
            with unset_fake_temporarily():
                return (t if t.constant is None else t.constant).item() if isinstance(t, FakeTensor) else t.item()
        self.reads += 1
        dt = t.dtype
        if self.queue and self.queue[0][0] == dt:
            v = self.queue.popleft()[1]
        elif self.fill is not None:
            v = self.fill
        else:
            v = 1.0
        if dt == torch.bool:
            return bool(v)
        return float(v) if dt.is_floating_point else int(v)


def _grouped_mm_shape(func, args, kwargs):
    """``torch._grouped_mm`` of float32 fakes: the CPU kernel takes float32 (what a real CPU run
    uses), its meta function bf16 only; the output's shape and strides are the bf16 meta's, its
    dtype the inputs'."""
    a, b = args[0], args[1]
    out = func(a.to(torch.bfloat16), b.to(torch.bfloat16), *args[2:], **kwargs)
    return torch.empty_strided(out.shape, out.stride(), dtype=a.dtype, device=a.device)


@contextlib.contextmanager
def fake_process_group(rank: int, world: int):
    """``init_process_group("fake")`` as ``rank`` of ``world``; destroyed on exit."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _swap_dropping_memo(orig, mode: FakeTensorMode, t1, t2):
    memo = mode.fake_tensor_converter.meta_converter.tensor_memo
    for k, v in list(memo.items()):  # the memo's weak references block the swap
        if v is t1 or v is t2:
            del memo[k]
    return orig(t1, t2)


def _reading_zero(reads: HostReads, fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with reads.as_value(0.0):
            return fn(*args, **kwargs)
    return wrapped


def _real_world(fn):
    """``fn`` run outside the fake mode (ZeRO's expert ``DeviceMesh``, built from the real mesh's
    rank tensor: its ranks are values the fake mode would not have)."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with unset_fake_temporarily():
            return fn(*args, **kwargs)
    return wrapped


def _empty_in_thread(shape, dtype, device):
    """A fake ``torch.empty`` made in another thread, as a real step's receiver thread makes it:
    outside the main thread's dispatch modes (the memory tracker sees it only once used). The
    main thread waits, so the fake mode is never used by two threads at once."""
    mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    out = []

    def make():
        with mode:
            out.append(torch.empty(shape, dtype=dtype, device=device))
    th = threading.Thread(target=make)
    th.start()
    th.join()
    return out[0]


def _inline_receiver(header):
    """``pp.p2p.Receiver`` in the fake world: no threads (``FakeTensorMode`` is not thread-safe, and
    a fake peer has always sent); each message is received in the main thread when taken, as a
    fake tensor of ``header(msg_tag)`` = (shape, dtype), what the peer would have announced; the
    ones never taken at ``join``. The same receives (header, then tensor) as a real step; the
    buffer made as a receiver thread makes it (``_empty_in_thread``)."""
    from ndtrain.parallel.pp import p2p

    class InlineReceiver(p2p.Receiver):
        def start(self, peer: int, keys) -> None:
            self.pending = getattr(self, "pending", {})
            self.pending.update({key: (peer, msg_tag) for key, msg_tag in keys})

        def take(self, key):
            peer, msg_tag = self.pending.pop(key)
            p2p.recv_async(torch.empty(p2p._META_LEN, dtype=torch.int64), self.group, peer, msg_tag).wait()
            buf = _empty_in_thread(*header(msg_tag), self.device)
            p2p.recv_async(buf, self.group, peer, msg_tag + 1).wait()
            return buf

        def join(self) -> None:
            for key in list(getattr(self, "pending", {})):
                self.take(key)
    return InlineReceiver


def _gather_own_object(out: list, obj, group=None) -> None:
    """``dist.all_gather_object`` in the fake world (it pickles through a real tensor): every
    peer answers this rank's object. Only diagnostics gather objects (``comm.all_gather_object``,
    which counts the bytes before the call); the pipeline's metric-name union is then this stage's
    names, so its two metric all-reduces may differ by a few floats from a real run's."""
    for i in range(len(out)):
        out[i] = obj


@contextlib.contextmanager
def fake_pipeline_messages(header):
    """Within ``fake_tensors``: pipeline messages received inline, shaped by ``header``."""
    from ndtrain.parallel.pp import runtime

    saved = runtime.Receiver
    runtime.Receiver = _inline_receiver(header)
    try:
        yield
    finally:
        runtime.Receiver = saved


@contextlib.contextmanager
def fake_tensors():
    """``FakeTensorMode`` + ``HostReads`` (yielded) for building and stepping a trainer; the
    parameter swap and the bad-step agreement adapted (module docstring), restored on exit."""
    from ndtrain.parallel.pp import stage_metrics
    from ndtrain.parallel.zero import sharded_state
    from ndtrain.train import trainer as trainer_mod

    mode, reads = FakeTensorMode(allow_non_fake_inputs=True), HostReads()
    saved = (torch.utils.swap_tensors, trainer_mod.agree_bad_ranks, trainer_mod.agree_bad_ranks_and_sum,
             dist.all_gather_object, stage_metrics._reduce, sharded_state.expert_domain)
    sharded_state.expert_domain = _real_world(saved[5])  # a device mesh: host bookkeeping, built for real
    stage_metrics._reduce = _reading_zero(reads, saved[4])  # no stage's metric names changed
    torch.utils.swap_tensors = functools.partial(_swap_dropping_memo, saved[0], mode)
    dist.all_gather_object = _gather_own_object
    trainer_mod.agree_bad_ranks = _reading_zero(reads, saved[1])
    trainer_mod.agree_bad_ranks_and_sum = _reading_zero(reads, saved[2])
    try:
        with mode, reads:
            yield reads
    finally:
        (torch.utils.swap_tensors, trainer_mod.agree_bad_ranks, trainer_mod.agree_bad_ranks_and_sum,
         dist.all_gather_object, stage_metrics._reduce, sharded_state.expert_domain) = saved
