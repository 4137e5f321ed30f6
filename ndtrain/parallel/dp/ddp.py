"""Data parallel: bucketed gradient all-reduce launched from gradient hooks, overlapped with backward.

The algorithm (PyTorch DDP, Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data
Parallel Training"): parameters are grouped, in reverse registration order (roughly the order
backward produces their gradients), into buckets of about ``bucket_size_bytes`` (``buckets.py``,
shared with ZeRO-1/2). A post-accumulate-grad hook marks a parameter ready; when every parameter of
a bucket is ready the bucket's gradients are flattened and an asynchronous all-reduce starts while
backward goes on. As in PyTorch DDP the first bucket closes at 1 MiB (the output head's gradient
goes out at once); unlike it, a parameter of at least a quarter of the bucket size (the embedding,
whose gradient comes last) gets a bucket of its own, so after backward only its all-reduce is
exposed, not a whole bucket's. The reduced gradients stay in the bucket: each ``p.grad`` becomes a
view of it (no copy back) unless the reduction dtype differs from the parameter's.

Three rules keep it exact and hang-free:

* Buckets are launched strictly in index order (``buckets.BucketLauncher``), so all ranks issue the
  same collectives in the same order even when hooks fire in different orders.
* ``finish_grad_sync()`` launches every bucket not launched yet, taking the gradient a parameter
  already holds, or zeros if it never got one (parameters unused in this step, possibly on some
  ranks only), so no rank waits for a collective the others never issue.
* The reduction is a SUM: the training loss is already divided by the number of valid tokens of the
  whole global batch, so summing gradients over ranks gives exactly the single-process gradient.

Inside ``no_sync()`` (non-final microbatches of a gradient-accumulation window) hooks do nothing and
gradients accumulate locally.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from ndtrain.mesh import AxisGroup
from ndtrain.parallel import comm
from ndtrain.parallel.dp.buckets import BucketLauncher, group_into_buckets, unique_named_params
from ndtrain.parallel.dp.grad_sync import ReplicatedGradSync

# PyTorch DDP's first bucket (``dist._DEFAULT_FIRST_BUCKET_BYTES``): the head's gradient goes out
# while the rest of backward runs
FIRST_BUCKET_BYTES = 2**20


class _Bucket:
    def __init__(self, params: list[nn.Parameter], reduce_dtype: torch.dtype):
        self.params, self.reduce_dtype = params, reduce_dtype
        self.flat: torch.Tensor | None = None  # (sum numel,) in reduce_dtype while in flight
        self.work = None


class DataParallel(ReplicatedGradSync):
    """Attach bucketed all-reduce to ``module``'s parameters over ``group`` (the ``dp`` axis).

    Args:
        module: the model (anything with ``named_parameters()``); its parameters must already be
            identical on every rank (same seed).
        group: the data-parallel AxisGroup.
        bucket_size_bytes: target bucket size, measured in the reduction dtype.
        reduce_dtype: dtype gradients are reduced in (None: the parameters' dtype; bf16 halves
            the traffic).

    Communication per step: one all-reduce of every gradient, 2 (N-1)/N * Psi * b bytes per rank.
    Optimizer, clipping and state dicts: ``grad_sync.ReplicatedGradSync``.
    """

    def __init__(self, module: nn.Module, group: AxisGroup, bucket_size_bytes: int = 25 * 2**20,
                 reduce_dtype: torch.dtype | None = None):
        self.module = module
        self.group = group
        self.sync = True
        named = unique_named_params(module)
        # the embedding, whose gradient comes last, alone at the tail: the exposed all-reduce after
        # backward is then that one parameter's, not a whole bucket's
        groups = group_into_buckets(named, bucket_size_bytes, reduce_dtype,
                                    first_bucket_bytes=min(FIRST_BUCKET_BYTES, bucket_size_bytes),
                                    alone_bytes=max(bucket_size_bytes // 4, 1))
        self.buckets = [_Bucket([p for _, p in grp], reduce_dtype or grp[0][1].dtype) for grp in groups]
        self._launcher = BucketLauncher([b.params for b in self.buckets], self._launch)
        if group.size > 1:
            for _, p in named:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no communication) inside the block."""
        old, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = old

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if self.sync:
            self._launcher.mark_ready(p)

    def _launch(self, i: int) -> None:
        b = self.buckets[i]
        parts = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in b.params]
        b.flat = torch.cat(parts).to(b.reduce_dtype)
        b.work = comm.all_reduce(b.flat, self.group, async_op=True)

    def finish_grad_sync(self) -> None:
        """Launch what is left (unused parameters get zeros), wait, and write the summed grads back."""
        if self.group.size == 1:
            return
        self._launcher.launch_rest()
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
            offset = 0
            for p in b.params:
                n = p.numel()
                g = b.flat[offset:offset + n].view_as(p)
                # same dtype: the gradient becomes a view of the reduced bucket (no copy back; the
                # bucket's storage is freed with the gradients at zero_grad)
                p.grad = g if g.dtype == p.dtype else g.to(p.dtype)
                offset += n
            b.flat, b.work = None, None
