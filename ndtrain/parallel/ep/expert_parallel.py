"""Expert parallel (GShard, Lepikhin 2020; the layout of torchtitan / Megatron-Core MoE; docs/moe.md).

The ``ep`` ranks (a chunk of dp_shard x cp) split each MoE layer's E experts into E/ep consecutive
blocks; everything else stays replicated and each rank routes its own tokens.
``ExpertParallelExperts`` (``ep.layers``) replaces ``GroupedExperts``: a count all-to-all, the
variable-size dispatch (``AllToAllV``), one grouped matmul over the local experts, the reverse
combine; the backward of each all-to-all is the reverse one. Bytes per layer and direction with
uniform routing: ``N k C b (ep-1)/ep`` (``bench/moe_all_to_all.py``). Capacity dropping happens
before dispatch, so it does not depend on ep.

Expert gradients already sum the whole ep group's tokens and are all-reduced over ``edp`` with a
plain SUM (the loss is normalised by the global token count). They are tagged ``("ep",)`` for the
grad norm. A rank whose experts get no tokens still runs every collective and produces zero, not
None, gradients. With ZeRO the sharded wrappers take over (``zero.domains``)."""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import nn

from ndtrain.mesh import AxisGroup, Mesh
from ndtrain.model.moe import MoE, moe_layers
from ndtrain.parallel import comm
from ndtrain.parallel.cp.moe_shards import sequence_shards
from ndtrain.parallel.dp.ddp import DataParallel
from ndtrain.parallel.dp.grad_sync import ReplicatedGradSync
from ndtrain.parallel.ep.layers import EXPERT_SPLIT_DIMS, EXPERT_WEIGHTS, ExpertParallelExperts
from ndtrain.parallel.ep.rules import check_experts

if TYPE_CHECKING:  # annotations only: the config package validates with parallel's rules
    from ndtrain.config import Config


def _global_load_reducer(group: AxisGroup, counts: torch.Tensor) -> torch.Tensor:
    comm.all_reduce(counts, group)
    return counts


def apply_ep(model: nn.Module, mesh: Mesh, cfg: Config) -> list[str]:
    """Shard every MoE layer's experts over ``ep`` in place, and install the Switch loss's load reducer
    (dp x cp for "global", cp for "microbatch") and, under cp, the ``SequenceShards``. Returns the
    expert parameters' names (also with ep 1 on a folded mesh: they reduce over ``edp``). On a
    folded mesh the experts are marked ``folded`` (the expert_tp split follows in
    ``ndtrain.parallel.tp.moe_layers.apply_expert_tp``). Raises ValueError if E is not divisible by ep."""
    ep = mesh.group("ep")
    # The Switch loss counts expert loads over its scope's tokens: "global" sums them over every
    # dp x cp rank; "microbatch" over the cp ranks, which hold the shards of one microbatch's
    # sequences (so a cp run counts the same tokens as the single process).
    scope_axis = "dp_cp" if cfg.model.moe_aux_scope == "global" else "cp"
    if cfg.model.moe_aux_loss_coef > 0 and mesh.group(scope_axis).size > 1:
        reducer = functools.partial(_global_load_reducer, mesh.group(scope_axis))
        for moe in moe_layers(model):
            moe.load_reducer = reducer
    shards = sequence_shards(mesh, cfg)  # cp > 1: per-sequence loads and capacity over whole sequences
    for moe in moe_layers(model):
        moe.seq_shards = shards
    folded = getattr(mesh.dims, "folded", False)  # the experts' own mesh: gradients reduce over edp
    if ep.size == 1 and not folded:
        return []
    names = []
    for name, moe in list(model.named_modules()):  # a snapshot: the loop replaces submodules
        if not isinstance(moe, MoE):
            continue
        if ep.size > 1:
            check_experts(moe.n_experts, ep.size)
            moe.experts = _ep_experts(moe, ep, mesh, cfg)
            moe.shared_overlap = bool(cfg.parallel.moe_shared_overlap) and moe.shared is not None
        moe.experts.folded = folded  # tp's plan leaves folded experts to the expert mesh
        names += [f"{name}.experts.{w}" for w in EXPERT_WEIGHTS]
    return names


def _ep_experts(moe: MoE, ep: AxisGroup, mesh: Mesh, cfg: Config) -> ExpertParallelExperts:
    """The layer's ep experts for ``parallel.moe_dispatch`` (flat or hierarchical, ``ep.hierarchical``);
    sets the router's node count for ``model.moe_max_nodes``."""
    p = cfg.parallel
    if p.moe_dispatch == "flat" and cfg.model.moe_max_nodes == 0:
        return ExpertParallelExperts(moe.experts, ep, tally=moe.stats)
    from ndtrain.parallel.ep import hier_rules, hierarchical

    node_size = hier_rules.resolve_node_size(p.node_size, mesh.dims.world_size)
    moe.route_nodes = hier_rules.ep_nodes(ep.size, node_size)
    if p.moe_dispatch == "flat":
        return ExpertParallelExperts(moe.experts, ep, tally=moe.stats)
    return hierarchical.HierarchicalExperts(moe.experts, ep, hierarchical.node_groups(mesh, node_size), moe.stats)


class _Params:
    """The minimal module view ``DataParallel`` needs: ``parameters()``."""

    def __init__(self, params: list[nn.Parameter]):
        self._params = params

    def parameters(self):
        return iter(self._params)


class ExpertDataParallel(ReplicatedGradSync):  # build_optimizer, clip_grad_norm: dp.grad_sync
    """The trainer's DP interface for an ep model: dense parameters summed over ``dense_group`` (dp, or
    dp_cp under cp), expert parameters over ``edp``."""

    def __init__(self, model: nn.Module, mesh: Mesh, cfg: Config, expert_names: list[str],
                 reduce_dtype: torch.dtype | None = None):
        self.module, self.mesh = model, mesh
        self.expert_names = expert_names
        named = dict(model.named_parameters())
        expert = [named[n] for n in expert_names]
        ids = {id(p) for p in expert}
        dense = [p for p in model.parameters() if id(p) not in ids]
        p = cfg.parallel
        self.dense = DataParallel(_Params(dense), mesh.group("dp_cp" if mesh.dims.cp > 1 else "dp"),
                                  p.bucket_size_bytes, reduce_dtype)
        self.expert = DataParallel(_Params(expert), mesh.group("edp"), p.bucket_size_bytes, reduce_dtype)
        self.expert_params = expert

    def no_sync(self):
        import contextlib

        stack = contextlib.ExitStack()
        stack.enter_context(self.dense.no_sync())
        stack.enter_context(self.expert.no_sync())
        return stack

    def finish_grad_sync(self) -> None:
        """Reduce both groups; an expert gradient still None becomes zeros."""
        self.dense.finish_grad_sync()
        self.expert.finish_grad_sync()
        for q in self.expert_params:
            if q.grad is None:
                q.grad = torch.zeros_like(q)

    # ---- checkpoint state: expert tensors as DTensors over the expert mesh ------------------------
    def _to_dtensor(self, t: torch.Tensor, name: str):
        """Shard(0) (experts) over ep and, on a folded mesh, Shard(F dim) over expert_tp: DCP then
        stores each expert tensor once under its single-process name and shape."""
        from torch.distributed.tensor import DTensor, Shard

        d = self.mesh.dims
        dims = ["ep"] if d.ep > 1 else []
        placements = [Shard(0)] if d.ep > 1 else []
        if d.folded and d.expert_tp > 1:
            dims.append("expert_tp")
            placements.append(Shard(EXPERT_SPLIT_DIMS[name.rsplit(".", 1)[1]]))
        dmesh = self.mesh.ep_device_mesh[tuple(dims)] if len(dims) > 1 else self.mesh.ep_device_mesh[dims[0]]
        return DTensor.from_local(t, dmesh, placements, run_check=False)

    def model_state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        sd = get_model_state_dict(self.module)
        for n in self.expert_names:
            sd[n] = self._to_dtensor(sd[n], n)
        return sd

    def load_model_state_dict(self, sd: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        sd = dict(sd)
        named = dict(self.module.named_parameters())
        with torch.no_grad():
            for n in self.expert_names:
                v = sd.pop(n)
                named[n].copy_(v.to_local() if hasattr(v, "to_local") else v)
        set_model_state_dict(self.module, sd, options=StateDictOptions(strict=False))

    def optim_state_dict(self, optimizer) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        sd = get_optimizer_state_dict(self.module, optimizer)
        state = dict(sd["state"])  # new dicts: the inner ones may be the optimizer's own
        for n in self.expert_names:
            if n in state:  # views of the optimizer's tensors, so a DCP load lands in place
                state[n] = {k: self._to_dtensor(v, n) if torch.is_tensor(v) and v.dim() > 0 else v
                            for k, v in state[n].items()}
        return dict(sd, state=state)

    def load_optim_state_dict(self, optimizer, sd: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        state = {n: {k: (v.to_local() if hasattr(v, "to_local") else v) for k, v in st.items()}
                 for n, st in sd["state"].items()}
        set_optimizer_state_dict(self.module, optimizer, dict(sd, state=state))
