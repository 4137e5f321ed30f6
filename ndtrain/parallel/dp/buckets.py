"""Gradient buckets shared by data parallel (all-reduce, ``ddp.py``) and ZeRO-1/2 (reduce-scatter,
``ndtrain.parallel.zero.zero12``): how parameters are grouped, and the order buckets are launched in.

Grouping (PyTorch DDP, Li et al. 2020): parameters in reverse registration order (roughly the order
backward produces their gradients) fill buckets of about ``bucket_size_bytes`` (measured in the
reduction dtype); a bucket closes at the first parameter that reaches the size.

Launch order: a post-accumulate-grad hook marks its parameter ready; a bucket whose parameters are
all ready is launched only after every bucket before it, so all ranks issue the same collectives in
the same order even when hooks fire in different orders. ``launch_rest`` launches what is left (at
the end of backward / of the step: parameters that got no gradient), so no rank waits for a
collective the others never issue.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def unique_named_params(module) -> list[tuple[str, nn.Parameter]]:
    """Trainable ``(name, parameter)`` pairs, a tied parameter once (under its first name).
    ``module`` may offer only ``parameters()`` (a parameter subset): names are then indices."""
    named = (module.named_parameters() if hasattr(module, "named_parameters")
             else ((str(i), p) for i, p in enumerate(module.parameters())))
    seen, out = set(), []
    for name, p in named:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def group_into_buckets(named: list[tuple[str, nn.Parameter]], bucket_size_bytes: int,
                       reduce_dtype: torch.dtype | None = None, first_bucket_bytes: int | None = None,
                       alone_bytes: int | None = None) -> list[list[tuple[str, nn.Parameter]]]:
    """Split ``named`` (registration order) into buckets, last parameters first (see module
    docstring). Sizes count ``reduce_dtype`` bytes (None: each parameter's own dtype).

    ``first_bucket_bytes``: the first bucket closes at this size instead (PyTorch DDP's 1 MiB
    ``_DEFAULT_FIRST_BUCKET_BYTES``), so the first all-reduce starts as soon as backward begins.
    ``alone_bytes``: a parameter at least this big gets a bucket of its own, so the smaller
    parameters ready before it (a first layer's, ahead of the embedding) are not held back for
    it. None keeps both off (ZeRO-1/2, whose memory the planner models with the plain rule)."""
    groups, current, size = [], [], 0
    for name, p in reversed(named):
        nb = p.numel() * torch.empty((), dtype=reduce_dtype or p.dtype).element_size()
        if alone_bytes is not None and nb >= alone_bytes and current:
            groups.append(current)
            current, size = [], 0
        current.append((name, p))
        size += nb
        cap = first_bucket_bytes if (first_bucket_bytes is not None and not groups) else bucket_size_bytes
        if size >= cap or (alone_bytes is not None and nb >= alone_bytes):
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    return groups


class BucketLauncher:
    """Launches buckets strictly in index order as their parameters become ready.

    Args:
        buckets: the parameters of each bucket (``group_into_buckets`` order).
        launch: ``launch(i)`` starts bucket ``i``'s (asynchronous) reduction.
    """

    def __init__(self, buckets: list[list[nn.Parameter]], launch: Callable[[int], None]):
        self.sizes = [len(b) for b in buckets]
        self.where = {id(p): (bi, pi) for bi, b in enumerate(buckets) for pi, p in enumerate(b)}
        self.ready: list[set[int]] = [set() for _ in buckets]
        self.launch = launch
        self.next = 0  # index of the next bucket to launch

    def mark_ready(self, p: nn.Parameter) -> None:
        """``p`` accumulated its gradient: launch every complete bucket that is next in line."""
        bi, pi = self.where[id(p)]
        self.ready[bi].add(pi)
        while self.next < len(self.sizes) and len(self.ready[self.next]) == self.sizes[self.next]:
            self._launch_next()

    def launch_rest(self) -> None:
        """Launch every bucket not launched yet (complete or not) and start over."""
        while self.next < len(self.sizes):
            self._launch_next()
        self.next = 0

    @property
    def started(self) -> bool:
        """Some but not all buckets of this round were launched."""
        return self.next > 0

    def _launch_next(self) -> None:
        self.ready[self.next].clear()
        self.launch(self.next)
        self.next += 1
