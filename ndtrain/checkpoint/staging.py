"""Staging for asynchronous checkpoints: an owned host copy of a state tree, taken while the
training loop waits, so that the background write never sees a later update.

Why not DCP's default stager: it copies each tensor's whole *storage* and re-creates views on it,
and decides whether a tensor has storage by ``data_ptr() != 0``. A DTensor is a wrapper without
storage of its own, but when its local tensor is a view at a non-zero offset (every ZeRO-1/2/3
master shard is a view into a flat buffer, ``ndtrain.parallel.zero.flat_shard``) the wrapper
reports ``data_ptr() == offset * itemsize``; the stager then copies the wrapper's invalid storage
and fails ("Attempted to call copy_() on an invalid python storage"). Here each tensor is copied
on its own: a plain tensor to a new CPU tensor, a DTensor to a DTensor of the same spec (mesh,
placements, global shape) around a CPU copy of its local tensor. Only the visible elements are
copied (a view's storage beyond it is not), so the host copy is the size of the state itself.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager

__all__ = ["OwnedCopyStager", "owned_cpu_copy"]


def owned_cpu_copy(tree: Any, memo: dict[int, Any] | None = None) -> Any:
    """A copy of ``tree`` (dicts / lists / tuples of tensors, DTensors and plain values) in which
    every tensor owns a fresh CPU storage; one object seen twice (a tied weight listed under two
    names) is copied once. Not collective."""
    memo = {} if memo is None else memo
    key = id(tree)
    if key in memo:
        return memo[key]
    if isinstance(tree, torch.Tensor):
        out = _copy_tensor(tree)
    elif isinstance(tree, dict):
        out = type(tree)((k, owned_cpu_copy(v, memo)) for k, v in tree.items())
    elif isinstance(tree, (list, tuple)):
        out = type(tree)(owned_cpu_copy(v, memo) for v in tree)
    else:
        out = copy.deepcopy(tree)
    memo[key] = out
    return out


def _copy_tensor(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        local = t.to_local().detach().to("cpu", copy=True)
        # the same spec: DCP writes the local chunk at its global offsets, from mesh + placements
        return DTensor(local, t._spec, requires_grad=False)
    return t.detach().to("cpu", copy=True)


class OwnedCopyStager(AsyncStager):
    """``AsyncStager`` for ``dcp.async_save`` whose ``stage`` returns ``owned_cpu_copy(state)``
    synchronously (the part of an asynchronous save the training loop waits for)."""

    _synchronize_after_execute = False  # stage() returns only after the copy is complete

    def stage(self, state_dict: dict) -> dict:
        with torch.no_grad():
            return owned_cpu_copy(state_dict)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` is synchronous."""

    def close(self) -> None:
        """Nothing held between saves."""
