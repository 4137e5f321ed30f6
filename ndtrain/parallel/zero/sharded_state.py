"""What ZeRO-1/2 and ZeRO-3 share: sharded fp32 master parameters, AdamW over them, global-norm
clipping of gradient shards, and state dicts that look the same under every layout (the gradient
reduction they share is in ``reduce.py``).

Each trainable parameter of the model becomes a ``ShardEntry``: its padded dim-0 shard (a view into
a flat master buffer, see ``flat_shard``) wrapped as an ``nn.Parameter`` that the optimizer steps.
AdamW is elementwise, so stepping shards is exactly stepping the full tensors (Rajbhandari et al.
2020, ZeRO); the decoupled weight decay still skips 1-D parameters because a shard keeps its
parameter's number of dims. Padding rows hold zeros with zero gradients and stay zero.

State dicts (the checkpoint contract, ``ndtrain.checkpoint``):

* model: ``{fqn: tensor}`` with the model's own names and global shapes, in the master dtype
  (fp32 / fp64, never the bf16 compute copy), as DTensors ``Shard(0)`` over ``dp_shard_cp``
  (``(Replicate(), Shard(0))`` over ``dp_replicate x dp_shard_cp`` for HSDP) whose local tensors
  are views of the live shards, so ``dcp.load`` writes in place; a 0-d parameter is presented
  whole on every rank (broadcast from the shard rank holding it: a 0-d DTensor cannot be sharded);
  every persistent buffer (e.g. the MoE ``expert_bias``) and frozen parameter, whole and equal on
  every rank, under its global name, exactly as ``model.state_dict()`` of one process names it;
* optimizer: ``{"state": {fqn: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [...]}``, the
  format of ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``, with the groups
  (decay, no-decay) listing FQNs in the order plain data parallel uses.

A checkpoint saved under any of DDP / ZeRO-1/2/3 / HSDP / one process therefore loads under any
other: DCP matches tensors by name and global shape and reshards the chunks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ndtrain.optim import build_optimizer, clip_grad_norm
from ndtrain.parallel import comm
from ndtrain.parallel.dp.grad_sync import sum_over_axes
from ndtrain.parallel.zero.flat_shard import FlatShardLayout
from ndtrain.parallel.zero.reduce import GradShardReducer


@dataclass
class ShardEntry:
    """One model parameter seen through its shard.

    Attributes: ``fqn`` (model name), ``shape`` (global), ``layout`` / ``index`` (where it lives in
    its flat buffer), ``param`` (padded master shard (r, *rest), the optimizer's parameter),
    ``axes`` (mesh axes the parameter was already split over before data parallel, e.g. ("tp",)),
    ``aliases`` (further names of a tied parameter; the state dict lists it under every name).
    """

    fqn: str
    shape: torch.Size
    layout: FlatShardLayout
    index: int
    param: nn.Parameter
    axes: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()  # other names of a tied parameter (e.g. output.weight)

    @property
    def valid_rows(self) -> int:
        return self.layout.valid_rows[self.index]

    def valid(self, t: torch.Tensor) -> torch.Tensor:
        """Rows of a padded shard-shaped tensor (param, grad, Adam moment) that are real."""
        return t[: self.valid_rows]


def contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


def replicated_state(module: nn.Module, sharded_names: set[str]) -> dict[str, torch.Tensor]:
    """Persistent buffers and parameters not in ``sharded_names`` (frozen ones), under the names
    ``module.state_dict()`` gives them (every name of a shared module)."""
    out = {}
    for prefix, m in module.named_modules(remove_duplicate=False):
        pre = f"{prefix}." if prefix else ""
        for name, t in m._parameters.items():
            if t is not None and pre + name not in sharded_names:
                out[pre + name] = t.detach()
        for name, t in m._buffers.items():
            if t is not None and name not in m._non_persistent_buffers_set:
                out[pre + name] = t
    return out


class ShardedDataParallelBase(GradShardReducer):
    """Optimizer / clipping / state-dict half of the data-parallel interface for sharded layouts.

    Subclasses set ``self.module``, ``self.entries`` (in ``named_parameters`` order), the groups
    ``self.shard_group`` (``dp_shard_cp``) and ``self.replicate_group`` (``dp_replicate``), call
    ``_init_dtensor_mesh(mesh)`` and ``GradShardReducer._init_reducer()``, and may override
    ``_after_step`` / ``_after_load``.
    """

    module: nn.Module
    entries: list[ShardEntry]
    optimizer: torch.optim.Optimizer | None = None

    def _init_dtensor_mesh(self, mesh) -> None:
        from torch.distributed.tensor import Replicate, Shard

        self._dmesh, self._placements = None, None
        if mesh.device_mesh is None or self.shard_group.size == 1:
            return  # shards are whole tensors: plain (replicated) tensors
        # with cp = 1 the root's dp_shard dim is dp_shard_cp (same ranks, same order); slicing a
        # flattened dim out of the root mesh is deprecated
        shard_dim = "dp_shard" if mesh.dims.cp == 1 else "dp_shard_cp"
        if self.replicate_group.size > 1:
            self._dmesh = mesh.device_mesh["dp_replicate", shard_dim]
            self._placements = (Replicate(), Shard(0))
        else:
            self._dmesh = mesh.device_mesh[shard_dim]
            self._placements = (Shard(0),)

    def _present(self, local: torch.Tensor, shape: torch.Size):
        """This rank's valid rows ``local`` as the global tensor of ``shape`` (see module docstring)."""
        if self._dmesh is None:
            return local.view(shape)  # one shard: the whole tensor
        if len(shape) == 0:  # 0-d: whole on every rank, from the shard rank that holds it
            t = local.reshape(-1)[:1].clone() if local.numel() else local.new_zeros(1)
            comm.broadcast(t, self.shard_group, 0)
            return t.view(())
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, self._dmesh, self._placements, run_check=False,
                                  shape=shape, stride=contiguous_stride(shape))

    @staticmethod
    def _local_rows(src, e: ShardEntry) -> torch.Tensor:
        """This rank's valid rows of ``src``: a DTensor of the same layout or a full tensor."""
        from torch.distributed.tensor import DTensor

        if isinstance(src, DTensor):
            return src.to_local()
        lo, hi = e.layout.row_range(e.index)
        return src.reshape(-1)[lo:hi] if src.dim() == 0 else src[lo:hi]

    # --- optimizer -------------------------------------------------------------------------
    def build_optimizer(self, tcfg) -> torch.optim.Optimizer:
        """AdamW (``ndtrain.optim.build_optimizer``) over the master shards, state created eagerly
        so state dicts exist before step 1; a step post-hook runs ``_after_step``."""
        opt = build_optimizer([(e.fqn, e.param) for e in self.entries], tcfg, eager_state=True)
        self.optimizer = opt
        opt.register_step_post_hook(lambda *_: self._after_step())
        return opt

    def _after_step(self) -> None:
        """Called after every optimizer step (ZeRO-1/2 all-gather the updated parameters)."""

    def _after_load(self) -> None:
        """Called after model weights were loaded into the master shards."""

    def clip_grad_norm(self, max_norm: float, mesh=None) -> float:
        """Global-norm clipping over the gradient shards: each element is counted once (padding
        excluded by taking only valid rows; shards summed over ``dp_shard_cp`` plus the axes the
        parameter carries; replicas over ``dp_replicate`` hold equal shards and are not summed)."""
        items = [(e.valid(e.param.grad), (self.shard_group.name,) + e.axes)
                 for e in self.entries if e.param.grad is not None]
        return clip_grad_norm(items, max_norm, sum_over_axes(mesh))

    # --- state dicts ------------------------------------------------------------------------
    def model_state_dict(self) -> dict:
        """``{fqn: master weights}`` with global shapes, plus persistent buffers and frozen
        parameters; the keys of one process's ``model.state_dict()`` (see the module docstring)."""
        out = {}
        for e in self.entries:
            t = self._present(e.valid(e.param.detach()), e.shape)
            out.update({name: t for name in (e.fqn,) + e.aliases})
        out.update(replicated_state(self.module, set(out)))
        return out

    @torch.no_grad()
    def load_model_state_dict(self, sd: dict) -> None:
        """Copy weights (DTensors of this layout or full tensors) into the master shards, and
        buffers / frozen parameters into the module. Raises KeyError for a missing name."""
        for e in self.entries:
            src = self._local_rows(sd[e.fqn], e)
            dst = e.valid(e.param.detach())
            if src.data_ptr() != dst.data_ptr() or src.dtype != dst.dtype:
                dst.copy_(src)
        names = {n for e in self.entries for n in (e.fqn,) + e.aliases}
        for name, dst in replicated_state(self.module, names).items():
            src = sd[name]
            src = src.full_tensor() if hasattr(src, "full_tensor") else src
            if src.data_ptr() != dst.data_ptr() or src.dtype != dst.dtype:
                dst.copy_(src)
        self._after_load()

    def _group_entries(self, optimizer) -> list[list[ShardEntry]]:
        by_param = {id(e.param): e for e in self.entries}
        return [[by_param[id(p)] for p in g["params"]] for g in optimizer.param_groups]

    def optim_state_dict(self, optimizer) -> dict:
        """AdamW state keyed by FQN (``get_optimizer_state_dict`` format), moments as DTensors."""
        state = {}
        for e in self.entries:
            st = optimizer.state[e.param]
            state[e.fqn] = {"step": st["step"],
                            "exp_avg": self._present(e.valid(st["exp_avg"]), e.shape),
                            "exp_avg_sq": self._present(e.valid(st["exp_avg_sq"]), e.shape)}
        groups = []
        for g, ents in zip(optimizer.param_groups, self._group_entries(optimizer)):
            d = {k: v for k, v in g.items() if k != "params"}
            d["params"] = [e.fqn for e in ents]
            groups.append(d)
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_optim_state_dict(self, optimizer, sd: dict) -> None:
        """Load moments / steps (any layout) and the groups' hyperparameters (lr, betas, ...).

        Raises ValueError if the saved groups list other parameters than this model's groups.
        """
        for e in self.entries:
            src, st = sd["state"][e.fqn], optimizer.state[e.param]
            if src["step"] is not st["step"]:
                st["step"].copy_(src["step"])
            for k in ("exp_avg", "exp_avg_sq"):
                s, d = self._local_rows(src[k], e), e.valid(st[k])
                if s.data_ptr() != d.data_ptr():
                    d.copy_(s)
        for g, saved, ents in zip(optimizer.param_groups, sd["param_groups"], self._group_entries(optimizer)):
            if list(saved["params"]) != [e.fqn for e in ents]:
                raise ValueError("optimizer param groups of the checkpoint do not match this model")
            g.update({k: v for k, v in saved.items() if k != "params"})
