"""The checkpoint adapter of a layout: every tensor whole, under its single-process global name.

``CheckpointAdapter.state(optimizer)`` is what a checkpoint stores: ``{"model": {fqn: tensor},
"optim": {"state": {fqn: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": {fqn: {...}}}}``,
where each tensor is either a plain whole tensor or a DTensor of global shape (ZeRO-3 / FSDP
shards: DCP writes each shard once and reassembles them on load). The per-axis adapters run in
a fixed order, because each finds its tensors by name:

  save: data-parallel wrapper's state dicts -> tp gather (by the stage's own names, so the last
        stage's ``output.weight`` finds its vocabulary split) -> pp rename (tied head under
        ``tok_embeddings.weight``, groups keyed by name)
  load: the inverse, pp first, then tp scatter, then the wrapper's ``load_*_state_dict``.

An outer loop (DiLoCo) rearranges the saved tree last (``OuterSync.pack``: its anchor and momentum
through the same tp gather as the parameters) and first on load (``unpack``).

Renaming before the gather saved one tp rank's slice of the tied
head's moments under the embedding's name.

Every plain tensor a load hands to the wrapper (so to the model and the optimizer) is contiguous
(``_contiguous``): torch's ``Optimizer.load_state_dict`` keeps the tensors it is given as the
moments, and its fused CPU AdamW updates non-contiguous moments wrongly (a tp-resharded
row-parallel moment, a column slice of the gathered tensor, moved a resumed run off by 5e-3). The
same path serves resume, ``checkpoint.load_from`` into another layout and the bad-step rollback.
DTensor entries are the layout's own template tensors, filled in place by DCP.
"""
from __future__ import annotations

import torch
from torch import nn

from ndtrain.mesh import Mesh
from ndtrain.parallel.api import GradSync, NoOuterSync, OuterSync
from ndtrain.parallel.pp.state import flatten_param_groups, unflatten_param_groups
from ndtrain.parallel.tp.state import gather_tp_state, scatter_tp_state


class CheckpointAdapter:
    """Save / load views of one rank's model and optimizer (see the module docstring).

    Args: the rank's parallelized ``model`` (or pipeline stage), its ``grad_sync``, the ``mesh``
    and its ``outer`` loop (``OuterSync``: DiLoCo's anchor and momentum take the parameters' path
    through ``whole`` / ``local``; None: no outer loop). Every method is collective over tp (and
    over data parallel for DTensor entries).
    """

    def __init__(self, model: nn.Module, grad_sync: GradSync, mesh: Mesh, outer: OuterSync | None = None):
        self.model, self.grad_sync, self.mesh = model, grad_sync, mesh
        self.outer = outer if outer is not None else NoOuterSync()

    def whole(self, tensors: dict) -> dict:
        """``{name: tensor shaped like this rank's parameter name}`` -> the whole tensors (tp
        gathered, padding dropped), as the parameters are saved."""
        return gather_tp_state({"model": tensors}, self.model, self.mesh)["model"]

    def local(self, tensors: dict) -> dict:
        """Inverse of ``whole``: this rank's (padded) slices."""
        return scatter_tp_state({"model": tensors}, self.model, self.mesh)["model"]

    def state(self, optimizer: torch.optim.Optimizer) -> dict:
        gs = self.grad_sync
        sd = {"model": gs.model_state_dict(), "optim": gs.optim_state_dict(optimizer)}
        sd = gather_tp_state(sd, self.model, self.mesh)
        return self.outer.pack({**sd, "optim": flatten_param_groups(sd["optim"], self.model)}, self.whole)

    def load(self, state: dict, optimizer: torch.optim.Optimizer) -> None:
        """``state``: a tree shaped like ``state(optimizer)`` (e.g. filled in place by DCP)."""
        state = self.outer.unpack(state, self.local)
        template = self.grad_sync.optim_state_dict(optimizer)
        state = {**state, "optim": unflatten_param_groups(state["optim"], template, self.model)}
        state = _contiguous(scatter_tp_state(state, self.model, self.mesh))
        self.grad_sync.load_model_state_dict(state["model"])
        self.grad_sync.load_optim_state_dict(optimizer, state["optim"])

    def load_model(self, model_state: dict) -> None:
        """Weights only (a fine-tune's start): ``model_state`` shaped like ``state()["model"]``."""
        state = _contiguous(scatter_tp_state({"model": model_state}, self.model, self.mesh))
        self.grad_sync.load_model_state_dict(state["model"])


def _contiguous(tree):
    """``tree`` (nested dicts / lists) with every non-contiguous plain tensor copied to contiguous
    storage; DTensors and everything else as they are (new containers, same leaves)."""
    if isinstance(tree, dict):
        return {k: _contiguous(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_contiguous(v) for v in tree]
    if type(tree) in (torch.Tensor, nn.Parameter) and not tree.is_contiguous():
        return tree.contiguous()
    return tree
