"""Operator loops that change nothing a rehearsal measures, run once per shape and replayed after.

ZeRO's gradient pack (``FlatShardLayout.pack_reference``, taken whenever the gradients' dtype
differs from ``reduce_dtype``: bf16 gradients reduced in fp32) copies one (rank, parameter) piece
at a time: per bucket and microbatch, for each of N ranks and P parameters, a copy and a zero
with about 6 views and 14 ``prim.device`` queries around them (seen), each a dispatched operator
costing the fake world tens of microseconds in Python: 82% of a measured step's time at N = 32
(llama3_70b, tp8 x dp_shard32, ZeRO-2, docs/rehearsal.md Round 5). On fake tensors the loop allocates
nothing and writes no metadata: its only trace in the measurement is the operator counter's rows
(``ops.OpRecorder``). So a call whose signature was seen before adds the rows the first call
counted instead of dispatching them again; with no counter active (the warm-up step) the loop is
skipped. The slow twin is the loop itself (``fast_paths(False)``): a whole rehearsal run both
ways must give the same figures (``tests/rehearsal/test_replay.py``).

A first call whose counted operators include anything but views and in-place writes (an
allocation would move MemTracker's figures) is never replayed: its signature runs the loop every
time."""
from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ndtrain.rehearsal import ops

# operators of kind "view" that allocate: a loop that runs one is not replayed
ALLOCATING = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "resize_", "set_"}


def _meta(t: torch.Tensor) -> tuple:
    return (t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), t.device.type)


def pack_signature(layout, tensors: list[torch.Tensor], out: torch.Tensor) -> tuple:
    """Everything the loop's operator sequence depends on: the layout (shapes, ranks, this rank),
    each tensor's dtype / shape / strides / offset, ``out``'s, and the phase the counter files
    the operators under (``ops._phase``)."""
    return (tuple(tuple(s) for s in layout.shapes), layout.n, layout.rank,
            tuple(_meta(t) for t in tensors), _meta(out), ops._phase())


def replayable(delta: dict) -> bool:
    """A first call's counted rows (``OpRecorder.delta``) may be replayed: views (that do not
    allocate) and in-place writes only."""
    return all((k[2] == "view" and k[0] not in ALLOCATING) or (k[0].endswith("_") and k[0] not in ALLOCATING)
               for k in delta)


class PackReplay:
    """The replacement of ``FlatShardLayout.pack_reference`` (module docstring); ``orig`` the loop.
    ``hits`` / ``misses`` / ``skipped``: calls replayed, run and counted, run outside a counter's
    reach (skipped: warm-up); ``refused``: signatures whose first call allocated."""

    def __init__(self, orig):
        self.orig = orig
        self.rows: dict[tuple, dict | None] = {}
        self.hits = self.misses = self.skipped = 0

    @property
    def refused(self) -> int:
        return sum(v is None for v in self.rows.values())

    def __call__(self, layout, tensors, out):
        if not isinstance(out, FakeTensor) or not all(isinstance(t, FakeTensor) for t in tensors):
            return self.orig(layout, tensors, out)  # real data: the copies are the point
        rec = ops.OpRecorder.active()
        if rec is None:  # nothing counts operators: the loop leaves no trace on fake tensors
            self.skipped += 1
            return out
        key = pack_signature(layout, tensors, out)
        if key in self.rows and self.rows[key] is not None:
            self.hits += 1
            rec.add_rows(self.rows[key])
            return out
        self.misses += 1
        before = rec.snapshot()
        self.orig(layout, tensors, out)
        if key not in self.rows:
            delta = rec.delta(before)
            self.rows[key] = delta if replayable(delta) else None
        return out


@contextlib.contextmanager
def fast_paths(enabled: bool = True):
    """Within: ``FlatShardLayout.pack_reference`` replayed (``PackReplay``, yielded) and
    ``prim.device`` past the counters' tree walks (``ops.OpRecorder.fast_device``); restored on
    exit. ``enabled`` False: both as dispatched (the slow twins); yields None."""
    from ndtrain.parallel.zero.flat_shard import FlatShardLayout

    saved = (FlatShardLayout.pack_reference, ops.OpRecorder.fast_device)
    ops.OpRecorder.fast_device = enabled
    replay = PackReplay(saved[0]) if enabled else None
    if enabled:
        FlatShardLayout.pack_reference = lambda self, tensors, out: replay(self, tensors, out)
    try:
        yield replay
    finally:
        FlatShardLayout.pack_reference, ops.OpRecorder.fast_device = saved
