"""Expert parallel (GShard, Lepikhin 2020; the layout of torchtitan / Megatron-Core MoE).

Layout: the ``ep`` ranks (a chunk of ``dp_shard x cp``, see ``ndtrain.mesh``) split each MoE
layer's E experts into E/ep consecutive blocks; rank r keeps experts [r E/ep, (r+1) E/ep). Router,
shared experts and everything else stay replicated. Each rank still routes its own tokens.

Forward of one MoE layer on one rank (``ExpertParallelExperts``, ``ndtrain.parallel.ep.layers``,
replaces the layer's ``GroupedExperts``; ``MoE.run_experts`` hands it the tokens of all experts):

1. the (E,) per-expert counts of the tokens this rank sorted by expert are exchanged with an
   all-to-all (ep x E/ep int64), so every rank knows how many rows it will receive;
2. **dispatch**: a variable-size all-to-all (``AllToAllV``) sends each destination the rows
   for its experts; received rows arrive grouped (source rank, local expert) and are permuted to
   (local expert, source rank) so each local expert's rows are contiguous;
3. the local experts run as one grouped matmul (``ndtrain.model.moe.grouped_mm``);
4. **combine**: the inverse permutation and the reverse all-to-all return every row to its source.

With ``parallel.moe_shared_overlap`` the dispatch of step 2 is started asynchronously and the
shared experts run while it is in flight (``ndtrain.parallel.ep.overlap``; bitwise the same result).

Backward mirrors it: each all-to-all's gradient is the reverse all-to-all. Bytes per layer per
direction, for N routed tokens per rank, top-k, width C and b bytes per element, with uniform
routing: ``N k C b (ep-1)/ep`` (``bench/moe_all_to_all.py`` measures it). Capacity dropping
happens before dispatch, on the source rank, so it does not depend on ep.

Gradients: an expert's weight gradient on its rank already sums over the tokens of the whole ep
group (they were sent to it). Ranks holding the same experts form the ``edp`` group
(dp_replicate x dp_shard x cp / ep); expert gradients are all-reduced over ``edp`` only, with a
plain SUM and no rescaling -- ndtrain's loss is normalised by the global token count, so summing
per-rank gradients gives the single-process gradient, for dense parameters over ``dp`` and for
expert parameters over ``edp`` alike. Expert parameters are tagged ``("ep",)`` so the global
grad norm sums them over ``ep`` once. A rank whose experts receive no tokens still runs every
collective (with zero rows) and still produces zero -- not None -- gradients, so AdamW keeps
stepping every expert's state identically on every replica.

Checkpoints store expert weights (and their AdamW moments) as DTensors ``Shard(0)`` over the ``ep``
mesh, so torch.distributed.checkpoint can reload them under another ep degree.

With ``parallel.zero_stage`` > 0 the ZeRO-1/2/3 wrappers replace ``ExpertDataParallel``: they shard
the expert parameters over ``edp_shard`` (the part of ``edp`` inside dp_shard x cp) and replicate
them over ``dp_replicate``, the dense ones over ``dp_shard_cp`` as usual
(``ndtrain.parallel.zero.domains``); the reduction is the same SUM over edp.
"""
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
from ndtrain.parallel.ep.layers import EXPERT_WEIGHTS, ExpertParallelExperts
from ndtrain.parallel.ep.rules import check_experts

if TYPE_CHECKING:  # annotations only: the config package validates with parallel's rules
    from ndtrain.config import Config


def _global_load_reducer(group: AxisGroup, counts: torch.Tensor) -> torch.Tensor:
    comm.all_reduce(counts, group)
    return counts


def apply_ep(model: nn.Module, mesh: Mesh, cfg: Config) -> list[str]:
    """Shard every MoE layer's experts over ``ep`` (in place) and install the load reducer of the
    Switch loss's statistics scope (dp x cp for "global", cp for "microbatch") and, under cp, the
    ``SequenceShards`` of the sequence-wise loss and the capacity. Returns the names of the expert
    parameters.

    Raises ValueError if E is not divisible by ep.
    """
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
    if ep.size == 1:
        return []
    names = []
    for name, moe in list(model.named_modules()):  # a snapshot: the loop replaces submodules
        if not isinstance(moe, MoE):
            continue
        check_experts(moe.n_experts, ep.size)
        moe.experts = ExpertParallelExperts(moe.experts, ep, tally=moe.stats)
        moe.shared_overlap = bool(cfg.parallel.moe_shared_overlap) and moe.shared is not None
        names += [f"{name}.experts.{w}" for w in EXPERT_WEIGHTS]
    return names


class _Params:
    """The minimal module view ``DataParallel`` needs: ``parameters()``."""

    def __init__(self, params: list[nn.Parameter]):
        self._params = params

    def parameters(self):
        return iter(self._params)


class ExpertDataParallel(ReplicatedGradSync):  # build_optimizer, clip_grad_norm: dp.grad_sync
    """Data parallel for an expert-parallel model: the trainer's DP interface (``no_sync``,
    ``finish_grad_sync``, ``build_optimizer``, ``clip_grad_norm``, state dicts), with dense
    parameters all-reduced over ``dense_group`` (dp, or dp_cp under cp) and expert parameters over
    ``edp``, both as sums (see module docstring).
    """

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
        """Reduce both groups; an expert gradient that is still None becomes zeros (never skipped)."""
        self.dense.finish_grad_sync()
        self.expert.finish_grad_sync()
        for q in self.expert_params:
            if q.grad is None:
                q.grad = torch.zeros_like(q)

    # ---- checkpoint state: expert tensors as DTensor Shard(0) over the ep mesh -------------------
    def _to_dtensor(self, t: torch.Tensor):
        from torch.distributed.tensor import DTensor, Shard

        return DTensor.from_local(t, self.mesh.ep_device_mesh["ep"], [Shard(0)], run_check=False)

    def model_state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        sd = get_model_state_dict(self.module)
        for n in self.expert_names:
            sd[n] = self._to_dtensor(sd[n])
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
                state[n] = {k: self._to_dtensor(v) if torch.is_tensor(v) and v.dim() > 0 else v
                            for k, v in state[n].items()}
        return dict(sd, state=state)

    def load_optim_state_dict(self, optimizer, sd: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        state = {n: {k: (v.to_local() if hasattr(v, "to_local") else v) for k, v in st.items()}
                 for n, st in sd["state"].items()}
        set_optimizer_state_dict(self.module, optimizer, dict(sd, state=state))
