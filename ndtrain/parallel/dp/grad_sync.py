"""What every data-parallel flavour shares for the trainer's ``GradSync`` interface
(``ndtrain.parallel.api``): the mesh reductions injected into clipping (``ndtrain.optim``) and loss
scaling (``ndtrain.precision``), which never touch process groups themselves, and the optimizer /
clipping / state-dict methods of layouts whose parameters are whole on every data-parallel rank
(``DataParallel``, ``ExpertDataParallel``).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ndtrain.optim import build_optimizer, clip_grad_norm, shard_axes
from ndtrain.parallel import comm

# every mesh axis; together they cover every rank exactly once
MESH_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def sum_over_axes(mesh) -> Callable[[torch.Tensor, tuple[str, ...]], None]:
    """``reduce(t, axes)``: all-reduce ``t`` in place (SUM) over each mesh axis in ``axes``, one
    after the other (the sum over their product). ``mesh`` None: only ``axes == ()`` is allowed.
    This is the ``reduce_sum`` of ``ndtrain.optim.clip_grad_norm``."""
    def reduce(t: torch.Tensor, axes: tuple[str, ...]) -> None:
        if axes and mesh is None:
            raise ValueError(f"gradients split over {axes} need the mesh to sum over")
        for axis in axes:
            comm.all_reduce(t, mesh.group(axis))
    return reduce


def max_over_mesh(mesh) -> Callable[[torch.Tensor], None]:
    """``reduce(t)``: max-reduce ``t`` in place over every rank of ``mesh`` (axis by axis, so each
    axis counts its bytes). The ``reduce_max`` of ``ndtrain.precision.LossScaler.unscale_and_check``."""
    def reduce(t: torch.Tensor) -> None:
        for axis in MESH_AXES:
            comm.all_reduce(t, mesh.group(axis), op=dist.ReduceOp.MAX)
    return reduce


class ReplicatedGradSync:
    """Optimizer, clipping and state dicts of a layout whose data-parallel ranks hold whole
    parameters (sharded at most by the axes tagged on them: tp / pp / ep).

    Subclasses set ``self.module`` (``named_parameters()`` / ``parameters()``) and implement
    ``no_sync`` / ``finish_grad_sync``. State dicts are those of
    ``torch.distributed.checkpoint.state_dict``: every parameter and persistent buffer under its
    global name, AdamW state keyed by name.
    """

    module: torch.nn.Module
    norm_uncounted: tuple = ()  # GradSync: scaled by clipping, not counted (set by parallelize)

    def build_optimizer(self, tcfg) -> torch.optim.Optimizer:
        """AdamW over the module's parameters (``ndtrain.optim.build_optimizer``)."""
        return build_optimizer(self.module.named_parameters(), tcfg)

    def clip_grad_norm(self, max_norm: float, mesh=None) -> float:
        """Global-norm clipping. Gradients are identical across the data-parallel ranks after the
        reduction, so only the axes a parameter is split over (tagged by TP / PP / EP) are summed."""
        mesh = mesh if mesh is not None else getattr(self, "mesh", None)
        skip = {id(p) for p in self.norm_uncounted}
        items = [(p.grad, shard_axes(p)) for p in self.module.parameters()
                 if p.grad is not None and id(p) not in skip]
        uncounted = [p.grad for p in self.norm_uncounted if p.grad is not None]
        return clip_grad_norm(items, max_norm, sum_over_axes(mesh), uncounted)

    def observe_memory(self, sampler) -> None:
        """Nothing to sample inside the hooks: the gradients are whole, already sampled between
        the pipeline's actions."""

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
