"""The gradient reduction ZeRO-1/2 buckets and ZeRO-3 units share (Rajbhandari et al. 2020).

A group (bucket or unit) has ``layout``, ``domain``, ``entries``, ``pending`` reduce-scatters
(``(work, out (S,), in (N*S,))``) and ``acc`` (accumulated shard (S,), master dtype). Gradients are
packed in ``reduce_dtype`` and reduce-scattered over the domain's shard group, at most two groups
in flight (bounding buffers); at the end of the step the shards are all-reduced over
``dp_replicate`` and handed to the masters as ``.grad``. Empty groups issue no collective."""
from __future__ import annotations

import torch

from ndtrain.mem_account import untracked
from ndtrain.parallel import comm
from ndtrain.parallel.zero.observe import Observers


class GradShardReducer:
    """Mixin of the ZeRO wrappers; they set ``master_dtype``, ``reduce_dtype``, each group's ``domain``,
    and call ``_init_reducer()``."""

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
        """All-reduce each group's ``acc`` over ``dp_replicate`` in ``reduce_dtype`` and set it as the
        masters' ``.grad``; a group without backward gets zeros (every rank steps the same state)."""
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
