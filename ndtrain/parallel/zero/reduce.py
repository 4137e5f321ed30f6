"""The gradient reduction ZeRO-1/2 buckets and ZeRO-3 units share (Rajbhandari et al. 2020).

A *group* (a ZeRO-1/2 bucket or a ZeRO-3 unit) has a ``layout`` (``flat_shard.FlatShardLayout``),
``domain`` (its ``domains.ShardDomain``: dense or expert, which names the groups below),
``entries`` (its ``ShardEntry`` s), ``pending`` (reduce-scatters in flight: ``(work, out (S,),
in (N*S,))``) and ``acc`` (its accumulated gradient shard (S,), master dtype, or None).

* ``_pack_grads``: the group's full gradients (zeros for parameters that got none) packed into
  the padded reduce-scatter input in ``reduce_dtype``; the full gradients are dropped.
* ``_start_reduce``: asynchronous reduce-scatter over the domain's shard group (``dp_shard_cp``;
  ``edp_shard`` for experts); at most two groups are in
  flight (the older one is completed first), which bounds the communication buffers.
* ``_complete``: wait and add the reduced shard into ``acc`` (master dtype).
* ``_publish_grad_shards``: end of the step: HSDP all-reduce over the domain's replicate group
  (``dp_replicate``) and hand ``acc``
  to the master parameters as ``.grad`` views.

Groups of zero elements (only empty parameters) issue no collective.
"""
from __future__ import annotations

import torch

from ndtrain.mem_account import untracked
from ndtrain.parallel import comm
from ndtrain.parallel.zero.observe import Observers


class GradShardReducer:
    """Mixin of ``ZeroDataParallel`` / ``FullyShardedDataParallel``; they set ``master_dtype``,
    ``reduce_dtype``, give every group a ``domain`` and call ``_init_reducer()``."""

    def _init_reducer(self) -> None:
        self._inflight: list = []  # groups with a reduce-scatter in flight, oldest first
        self._callback_queued = False
        self.observers = Observers()  # instrumentation slots (``observe.py``); empty = no work

    def _queue_end_of_backward(self) -> None:
        """Run ``self._end_of_backward`` once when autograd finishes this backward."""
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        raise NotImplementedError

    def _pack_grads(self, g, params: list, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(reduce-scatter input (N*S,), output (S,)) of group ``g``; ``params``' grads are freed."""
        with untracked():
            grads = [p.grad if p.grad is not None else torch.zeros(p.shape, dtype=p.dtype, device=device)
                     for p in params]
            full = g.layout.pack(grads, torch.empty(g.layout.padded_numel, dtype=self.reduce_dtype,
                                                    device=device))
            out = torch.empty(g.layout.shard_numel, dtype=self.reduce_dtype, device=device)
        del grads
        for p in params:
            p.grad = None
        return full, out

    def _start_reduce(self, g, full: torch.Tensor, out: torch.Tensor) -> None:
        group = g.domain.shard_group
        work = comm.reduce_scatter_into(out, full, group, async_op=True) if full.numel() else None
        g.pending.append((work, out, full))
        self._inflight.append(g)
        if self.observers:
            self.observers.state(self)
        while len(self._inflight) > 1:  # at most two groups in flight: bounded buffer memory
            self._complete(self._inflight.pop(0))

    def _complete(self, g) -> None:
        work, out, _ = g.pending.pop(0)
        if work is not None:
            work.wait()
        if g.acc is None:
            g.acc = out if out.dtype == self.master_dtype else out.to(self.master_dtype)
        else:
            g.acc.add_(out)

    def _drain(self) -> None:
        while self._inflight:
            self._complete(self._inflight.pop(0))

    def _publish_grad_shards(self, groups, device: torch.device) -> None:
        """End of backward: all-reduce each group's accumulated gradient shard ``acc`` over
        ``dp_replicate`` (HSDP), in ``reduce_dtype``, then hand it to the master parameters as
        ``.grad`` views. A group that saw no backward gets zeros, so every rank steps the same
        optimizer state."""
        works = []
        for g in groups:
            if g.acc is None:
                g.acc = torch.zeros(g.layout.shard_numel, dtype=self.master_dtype, device=device)
            rep = g.domain.replicate_group
            if rep.size > 1 and g.acc.numel():
                t = g.acc if self.reduce_dtype == self.master_dtype else g.acc.to(self.reduce_dtype)
                works.append((g, t, comm.all_reduce(t, rep, async_op=True)))
        for g, t, w in works:
            w.wait()
            if t is not g.acc:
                g.acc.copy_(t)
        for g in groups:
            for e in g.entries:
                e.param.grad = g.layout.shard_view(g.acc, e.index)
            g.acc = None  # owned by the optimizer's .grad now; freed by zero_grad(set_to_none=True)
