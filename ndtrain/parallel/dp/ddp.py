"""Data parallel: bucketed gradient all-reduce launched from gradient hooks, overlapped with backward.

The algorithm (PyTorch DDP, Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data
Parallel Training"): parameters are grouped, in reverse registration order (roughly the order
backward produces their gradients), into buckets of about ``bucket_size_bytes``. A
post-accumulate-grad hook marks a parameter ready; when every parameter of a bucket is ready the
bucket's gradients are flattened and an asynchronous all-reduce starts while backward goes on.

Three rules keep it exact and hang-free:

* Buckets are launched strictly in index order (a ready bucket waits for its predecessors), so all
  ranks issue the same collectives in the same order even when hooks fire in different orders.
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


class _Bucket:
    def __init__(self, params: list[nn.Parameter], reduce_dtype: torch.dtype):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.reduce_dtype = reduce_dtype
        self.ready: set[int] = set()
        self.flat: torch.Tensor | None = None
        self.work = None

    def reset(self) -> None:
        self.ready.clear()
        self.flat = None
        self.work = None


class DataParallel:
    """Attach bucketed all-reduce to ``module``'s parameters over ``group`` (the ``dp`` axis).

    Args:
        module: the model; its parameters must already be identical on every rank (same seed).
        group: the data-parallel AxisGroup.
        bucket_size_bytes: target bucket size, measured in the reduction dtype.
        reduce_dtype: dtype gradients are reduced in (fp32 default; bf16 halves the traffic).

    Communication per step: one all-reduce of every gradient, 2 (N-1)/N * Psi * b bytes per rank.
    """

    def __init__(self, module: nn.Module, group: AxisGroup, bucket_size_bytes: int = 25 * 2**20,
                 reduce_dtype: torch.dtype | None = None):
        self.module = module
        self.group = group
        self.sync = True
        params = [p for p in module.parameters() if p.requires_grad]
        seen, unique = set(), []
        for p in params:  # tied weights appear once
            if id(p) not in seen:
                seen.add(id(p))
                unique.append(p)
        self.buckets: list[_Bucket] = []
        current, size = [], 0
        for p in reversed(unique):
            rd = reduce_dtype or p.dtype
            current.append(p)
            size += p.numel() * torch.empty((), dtype=rd).element_size()
            if size >= bucket_size_bytes:
                self.buckets.append(_Bucket(current, rd))
                current, size = [], 0
        if current:
            self.buckets.append(_Bucket(current, reduce_dtype or current[0].dtype))
        self._where = {}
        for bi, b in enumerate(self.buckets):
            for pi, p in enumerate(b.params):
                self._where[id(p)] = (bi, pi)
        self._next_launch = 0
        self._hooks = []
        if group.size > 1:
            for p in unique:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no communication) inside the block."""
        old, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = old

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self.sync:
            return
        bi, pi = self._where[id(p)]
        self.buckets[bi].ready.add(pi)
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets):
            b = self.buckets[self._next_launch]
            if len(b.ready) < len(b.params):
                return
            self._launch(b)
            self._next_launch += 1

    def _launch(self, b: _Bucket) -> None:
        parts = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in b.params]
        b.flat = torch.cat(parts).to(b.reduce_dtype)
        b.work = comm.all_reduce(b.flat, self.group, async_op=True)

    def finish_grad_sync(self) -> None:
        """Launch what is left (unused parameters get zeros), wait, and write the summed grads back."""
        if self.group.size == 1:
            return
        while self._next_launch < len(self.buckets):
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1
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
            b.reset()
        self._next_launch = 0

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # --- optimizer, clipping and state: the interface the trainer uses for every DP flavour ---
    def build_optimizer(self, tcfg):
        """AdamW over the (replicated) parameters; see ``ndtrain.optim``."""
        from ndtrain.optim import build_optimizer

        return build_optimizer(self.module.named_parameters(), tcfg)

    def clip_grad_norm(self, max_norm: float, mesh=None) -> float:
        """Global-norm clipping. Gradients are identical across ``dp`` after the all-reduce, so
        only axes a parameter is sharded over (tagged by TP / PP / EP) are summed over."""
        from ndtrain.optim import clip_grad_norm, shard_axes

        items = [(p.grad, shard_axes(p)) for bk in self.buckets for p in bk.params if p.grad is not None]
        return clip_grad_norm(items, max_norm, mesh)

    def model_state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.module)

    def load_model_state_dict(self, sd: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.module, sd)

    def optim_state_dict(self, optimizer) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.module, optimizer)

    def load_optim_state_dict(self, optimizer, sd: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.module, optimizer, sd)
