"""MoE statistics under cp: every MoE layer's ``SequenceShards``, so the sequence-wise loss and the
capacity see whole sequences as in one process (``ndtrain.model.moe_capacity``)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ndtrain.mesh import Mesh
from ndtrain.mixer_spec import non_softmax_mixers
from ndtrain.model.moe_capacity import SequenceShards
from ndtrain.parallel import comm
from ndtrain.parallel.cp.context_parallel import chunk_ids
from ndtrain.parallel.cp.rules import resolve_layout

if TYPE_CHECKING:  # annotations only: the config package validates with parallel's rules
    from ndtrain.config import Config


def sequence_shards(mesh: Mesh, cfg: Config) -> SequenceShards | None:
    """The cp group's sharding of each sequence (the batch plan's layout) with its sum and gather; None
    when cp = 1."""
    group = mesh.group("cp")
    if group.size == 1:
        return None
    layout = resolve_layout(cfg.parallel.cp_impl, cfg.parallel.cp_layout, non_softmax_mixers(cfg.model))

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        comm.all_reduce(t, group)
        return t

    def all_gather(t: torch.Tensor) -> torch.Tensor:
        out = t.new_empty((group.size,) + tuple(t.shape))  # (cp, ...) rank order
        comm.all_gather_into(out.view(-1), t.contiguous().view(-1), group)
        return out

    chunks = tuple(chunk_ids(group.size, r, layout) for r in range(group.size))
    return SequenceShards(group.rank, chunks, all_reduce, all_gather)
