"""What ZeRO-1/2 and ZeRO-3 share: sharded fp32 master parameters, AdamW over them, global-norm
clipping of gradient shards, and state dicts that look the same under every layout (the gradient
reduction they share is in ``reduce.py``).

Each trainable parameter of the model becomes a ``ShardEntry``: its padded dim-0 shard (a view into
a flat master buffer, see ``flat_shard``) wrapped as an ``nn.Parameter`` that the optimizer steps.
AdamW is elementwise, so stepping shards is exactly stepping the full tensors (Rajbhandari et al.
2020, ZeRO); the decoupled weight decay still skips 1-D parameters because a shard keeps its
parameter's number of dims. Padding rows hold zeros with zero gradients and stay zero.

State dicts (the checkpoint contract, ``ndtrain.checkpoint.dcp``):

* model: ``{fqn: tensor}`` with the model's own names and global shapes, in the master dtype
  (fp32 / fp64, never the bf16 compute copy), as DTensors ``Shard(0)`` over ``dp_shard_cp``
  (``(Replicate(), Shard(0))`` over ``dp_replicate x dp_shard_cp`` for HSDP; expert weights under
  expert parallel: ``Shard(0)`` over ep, then over ``edp_shard``, see ``domains.py``) whose local
  tensors are views of the live shards, so ``dcp.load`` writes in place; a 0-d parameter is presented
  whole on every rank (broadcast from the shard rank holding it: a 0-d DTensor cannot be sharded);
  every persistent buffer (e.g. the MoE ``expert_bias``) and frozen parameter, whole and equal on
  every rank, under its global name, exactly as ``model.state_dict()`` of one process names it;
* optimizer: ``{"state": {fqn: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [...]}``, the
  format of ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``, with the groups
  (decay, no-decay) listing FQNs in the order plain data parallel uses.

A checkpoint saved under any of DDP / ZeRO-1/2/3 / HSDP / one process, with or without expert
parallel, therefore loads under any other: DCP matches tensors by name and global shape and
reshards the chunks.

Each entry belongs to a shard domain (``domains.py``): dense parameters are sharded over
``dp_shard_cp``, expert parameters (ep > 1) over ``edp_shard``; both are replicated over
``dp_replicate``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ndtrain.optim import build_optimizer, clip_grad_norm
from ndtrain.parallel.dp.grad_sync import sum_over_axes
from ndtrain.parallel.zero.domains import ShardDomain, dense_domain, expert_domain
from ndtrain.parallel.zero.flat_shard import FlatShardLayout
from ndtrain.parallel.zero.reduce import GradShardReducer


@dataclass
class ShardEntry:
    """One model parameter seen through its shard.

    Attributes: ``fqn`` (model name), ``shape`` (global), ``layout`` / ``index`` (where it lives in
    its flat buffer), ``param`` (padded master shard (r, *rest), the optimizer's parameter),
    ``axes`` (mesh axes the parameter was already split over before data parallel, e.g. ("tp",)),
    ``aliases`` (further names of a tied parameter; the state dict lists it under every name),
    ``domain`` (its ``ShardDomain``: where it is sharded and how it is presented; ``shape`` is
    rank-local, e.g. (E/ep, ...) for an expert weight).
    """

    fqn: str
    shape: torch.Size
    layout: FlatShardLayout
    index: int
    param: nn.Parameter
    axes: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()  # other names of a tied parameter (e.g. output.weight)
    domain: ShardDomain | None = None

    @property
    def valid_rows(self) -> int:
        return self.layout.valid_rows[self.index]

    def valid(self, t: torch.Tensor) -> torch.Tensor:
        """Rows of a padded shard-shaped tensor (param, grad, Adam moment) that are real."""
        return t[: self.valid_rows]


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

    Subclasses call ``_init_domains(mesh, expert_names)`` first (the shard domains: ``self.dense``
    and, with expert parallel, ``self.expert``; ``self.shard_group`` / ``self.replicate_group`` are
    the dense domain's groups), set ``self.module``, ``self.entries`` (in ``named_parameters``
    order, each with its domain), call ``GradShardReducer._init_reducer()``, and may override
    ``_after_step`` / ``_after_load``.
    """

    module: nn.Module
    entries: list[ShardEntry]
    optimizer: torch.optim.Optimizer | None = None

    def _init_domains(self, mesh, expert_names=()) -> None:
        """The dense domain, and the expert one when ``expert_names`` (the expert parameters
        ``apply_ep`` returned) is not empty (``domains.py``)."""
        self.dense = dense_domain(mesh)
        self.expert = expert_domain(mesh) if expert_names else None
        self.expert_names = set(expert_names)
        self.shard_group, self.replicate_group = self.dense.shard_group, self.dense.replicate_group

    def domain_of(self, fqn: str) -> ShardDomain:
        return self.expert if fqn in self.expert_names else self.dense

    @staticmethod
    def _present(local: torch.Tensor, e: ShardEntry):
        """This rank's valid rows ``local`` of entry ``e`` as the global tensor (module docstring)."""
        return e.domain.present(local, e.shape)

    @staticmethod
    def _local_rows(src, e: ShardEntry) -> torch.Tensor:
        """This rank's valid rows of ``src``: a DTensor of the same layout or a full global tensor."""
        return e.domain.local_rows(src, e)

    # --- optimizer -------------------------------------------------------------------------
    def build_optimizer(self, tcfg) -> torch.optim.Optimizer:
        """AdamW (``ndtrain.optim.build_optimizer``) over the master shards, state created eagerly
        so state dicts exist before step 1; a step post-hook runs ``_after_step``."""
        return self.adopt_optimizer(build_optimizer([(e.fqn, e.param) for e in self.entries], tcfg, eager_state=True))

    def adopt_optimizer(self, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Make ``opt`` (over the master shards, eager state) this layout's optimizer: a step
        post-hook runs ``_after_step`` (``ndtrain.parallel.muon`` builds Muon this way)."""
        self.optimizer = opt
        opt.register_step_post_hook(lambda *_: self._after_step())
        return opt

    def _after_step(self) -> None:
        """Called after every optimizer step (ZeRO-1/2 all-gather the updated parameters)."""

    def _after_load(self) -> None:
        """Called after model weights were loaded into the master shards."""

    def clip_grad_norm(self, max_norm: float, mesh=None) -> float:
        """Global-norm clipping over the gradient shards: each element is counted once. Padding is
        excluded by taking only valid rows; a dense shard's squares are summed over
        ``dp_shard_cp`` (its row chunks) plus the axes the parameter carries (tp, pp); an expert
        shard's over ``edp_shard`` (its row chunks) and ``ep`` (the expert blocks, tagged on the
        parameter): edp_shard x ep covers the dp_shard x cp block once, as dp_shard_cp does.
        Replicas over ``dp_replicate`` hold equal shards and are not summed."""
        items = [(e.valid(e.param.grad), (e.domain.shard_group.name,) + e.axes)
                 for e in self.entries if e.param.grad is not None]
        return clip_grad_norm(items, max_norm, sum_over_axes(mesh))

    # --- state dicts ------------------------------------------------------------------------
    def model_state_dict(self) -> dict:
        """``{fqn: master weights}`` with global shapes, plus persistent buffers and frozen
        parameters; the keys of one process's ``model.state_dict()`` (see the module docstring)."""
        out = {}
        for e in self.entries:
            t = self._present(e.valid(e.param.detach()), e)
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
        """Optimizer state keyed by FQN (``get_optimizer_state_dict`` format), moments as DTensors."""
        state = {}
        for e in self.entries:
            st = optimizer.state[e.param]  # step + shard-shaped moments (AdamW's, or Muon's momentum)
            state[e.fqn] = {k: self._present(e.valid(v), e) if k != "step" else v for k, v in st.items()}
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
            for k in (k for k in st if k != "step"):
                s, d = self._local_rows(src[k], e), e.valid(st[k])
                if s.data_ptr() != d.data_ptr():
                    d.copy_(s)
        for g, saved, ents in zip(optimizer.param_groups, sd["param_groups"], self._group_entries(optimizer)):
            if list(saved["params"]) != [e.fqn for e in ents]:
                raise ValueError("optimizer param groups of the checkpoint do not match this model")
            g.update({k: v for k, v in saved.items() if k != "params"})
