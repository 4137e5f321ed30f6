"""What ZeRO-1/2 and ZeRO-3 share: fp32 master shards, AdamW over them, clipping, layout-free state
dicts (docs/sharded_data_parallel.md, "Checkpoints that reshard").

A ``ShardEntry``'s padded row-first shard (``flat_shard``) is the optimizer's parameter; AdamW is elementwise, so this
is stepping the full tensors (ZeRO, Rajbhandari et al. 2020), and a shard keeps its number of dims
(decay still skips 1-D parameters). State dicts use the single-process names and global shapes:
DTensors viewing the live shards (``dcp.load`` writes in place), 0-d parameters and buffers whole,
optimizer state in ``get_optimizer_state_dict`` format, so a checkpoint of any layout loads under
any other."""
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
    """One parameter seen through its shard: ``fqn``, ``shape`` (rank-local pre-ZeRO, e.g. (E/ep, ...)),
    ``layout`` / ``index`` (place in the flat buffer), ``param`` (padded row-first shard,
    ``layout.shard_shape(index)``), ``axes``
    (axes already split before dp, e.g. ("tp",)), ``aliases`` (further names of a tied parameter),
    ``domain`` (its ``ShardDomain``)."""

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
    """Persistent buffers and frozen parameters, under ``module.state_dict()``'s names."""
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
    """Optimizer / clipping / state-dict half of the sharded layouts' data-parallel interface.

    Subclasses call ``_init_domains(mesh, expert_names)``, set ``self.module`` and ``self.entries``
    (``named_parameters`` order), call ``GradShardReducer._init_reducer()``, and may override
    ``_after_step`` / ``_after_load``."""

    module: nn.Module
    entries: list[ShardEntry]
    optimizer: torch.optim.Optimizer | None = None
    norm_uncounted: tuple = ()  # GradSync: scaled by clipping, not counted (set by parallelize)

    def observe_memory(self, sampler) -> None:
        """Sample memory inside the gather / reduce hooks (``observe.py``); None detaches."""
        self.observers["memory"] = sampler

    def _init_domains(self, mesh, expert_names=()) -> None:
        """The dense domain, plus the expert one when ``expert_names`` is not empty."""
        self.dense = dense_domain(mesh)
        self.expert = expert_domain(mesh) if expert_names else None
        self.expert_names = set(expert_names)
        self.shard_group, self.replicate_group = self.dense.shard_group, self.dense.replicate_group

    def domain_of(self, fqn: str) -> ShardDomain:
        return self.expert if fqn in self.expert_names else self.dense

    @staticmethod
    def _present(local: torch.Tensor, e: ShardEntry):
        """This rank's valid rows ``local`` of entry ``e`` as the global tensor."""
        return e.domain.present(e.layout.natural(local, e.index), e.shape, e.layout.dims[e.index])

    @staticmethod
    def _local_rows(src, e: ShardEntry) -> torch.Tensor:
        """This rank's valid rows of ``src``: a DTensor of the same layout or a full global tensor."""
        return e.domain.local_rows(src, e)

    # --- optimizer -------------------------------------------------------------------------
    def build_optimizer(self, tcfg) -> torch.optim.Optimizer:
        """AdamW (``ndtrain.optim.build_optimizer``) over the master shards, state created eagerly
        so state dicts exist before step 1; a step post-hook runs ``_after_step``."""
        opt = build_optimizer([(e.fqn, e.param) for e in self.entries], tcfg, eager_state=True)
        return self.adopt_optimizer(opt)

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
        """Global-norm clipping over valid gradient rows, each element counted once: dense squares summed over
        ``dp_shard_cp`` and the parameter's own axes (tp, pp); expert squares over ``edp_shard`` and ``ep``
        (which together cover dp_shard x cp once). ``dp_replicate`` replicas are not summed."""
        skip = {id(p) for p in self.norm_uncounted}
        items = [(e.valid(e.param.grad), (e.domain.shard_group.name,) + e.axes)
                 for e in self.entries if e.param.grad is not None and id(e.param) not in skip]
        uncounted = [p.grad for p in self.norm_uncounted if p.grad is not None]
        return clip_grad_norm(items, max_norm, sum_over_axes(mesh), uncounted)

    # --- state dicts ------------------------------------------------------------------------
    def model_state_dict(self) -> dict:
        """``{fqn: master weight}`` (global shapes) plus buffers: one process's ``model.state_dict()``
        keys."""
        out = {}
        for e in self.entries:
            t = self._present(e.valid(e.param.detach()), e)
            out.update({name: t for name in (e.fqn,) + e.aliases})
        out.update(replicated_state(self.module, set(out)))
        return out

    @torch.no_grad()
    def load_model_state_dict(self, sd: dict) -> None:
        """Copy weights (DTensors of this layout or full tensors) into the shards, buffers into the module.
        Raises KeyError for a missing name."""
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
        """Load moments / steps (any layout) and the groups' hyperparameters. Raises ValueError if the saved
        groups list other parameters than this model's."""
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
