"""Data parallel: bucketed gradient all-reduce launched from gradient hooks, overlapped with backward.

The algorithm (PyTorch DDP, Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data
Parallel Training"): parameters are grouped, in reverse registration order (roughly the order
backward produces their gradients), into buckets of about ``bucket_size_bytes`` (``buckets.py``,
shared with ZeRO-1/2). A post-accumulate-grad hook marks a parameter ready; when every parameter of
a bucket is ready the bucket's gradients are flattened and an asynchronous all-reduce starts while
backward goes on.

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
        self.buckets = [_Bucket([p for _, p in grp], reduce_dtype or grp[0][1].dtype)
                        for grp in group_into_buckets(named, bucket_size_bytes, reduce_dtype)]
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
                g = b.flat[offset:offset + n].view_as(p).to(p.dtype)
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
                offset += n
            b.flat, b.work = None, None
