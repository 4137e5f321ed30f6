"""Tensor parallel (Megatron-LM, Shoeybi et al. 2019) with optional sequence parallel (Korthikanti
et al. 2022), applied from outside to a single-device ``Transformer``.

Each block's two halves become one tensor-parallel region each:

* attention: ``wq`` / ``wk`` / ``wv`` column-parallel (rows of the weight split by heads), ``wo``
  row-parallel (columns split the same way); each rank runs the attention of its own heads;
* MLP: ``w1`` / ``w3`` column-parallel (hidden units split), ``w2`` row-parallel.

What goes where is a plan table (``ndtrain.parallel.tp.plan.llama_tp_plan``: module-name pattern ->
style). Each style installs a visible module (``ndtrain.parallel.tp.layers``) in place of the
single-device one, owning the parameter under the same name, so ``print(model)`` shows every
layer's sharding and state-dict keys do not change; the model reads head counts from weight shapes.
The f / g operators sit at the region boundaries: f is the region's ``tp_input`` child (called by
a forward pre-hook), g is the row-parallel linear's output. Without SP f is ``CopyToTP`` (fwd
identity, bwd all-reduce) and g ``ReduceFromTP`` (fwd all-reduce, bwd identity); with SP the
residual stream stays split along the sequence, f is ``GatherFromSequence`` (fwd all-gather, bwd
reduce-scatter) and g ``ReduceScatterToSequence`` (fwd reduce-scatter, bwd all-gather), and the
norm gains, used on different tokens by each rank, get their gradients summed over ``tp``
(``SequenceParallelNorm``: ``CopyWeightToTP`` on the gain).

Vocabulary: the embedding and output head are split by vocabulary rows; V is padded to
``Vp = tp * ceil(V / tp)`` with zero rows. The padded logits are masked to -inf inside
``vocab_parallel_cross_entropy`` (``ndtrain.parallel.tp.vocab_loss``), so they never get probability,
gradient or weight updates, and state dicts (``tp_full_tensor``) drop them.

Grouped-query attention: with ``G % tp == 0`` kv heads are split like q heads. With ``G < tp``
and ``tp % G == 0`` every rank keeps the whole (small) ``wk`` / ``wv`` and uses the one kv head its
q heads belong to (q head block r -> kv head ``r // (tp / G)``; ``ReplicatedKVLinear``); the weight
goes through ``CopyWeightToTP`` so each kv head's gradient is the sum over the ranks that used it.
Other ratios are rejected.

Token mixers other than softmax attention (linear attention, Mamba-2, Gated DeltaNet, sliding
window, DSA) split by heads too; their plan entries and the block-wise split of fused weights are
in ``ndtrain.parallel.tp.mixer_plan``. The recurrent states are per head: no extra communication.

Gradient dtype: the weight-gradient all-reduces of this axis (SP norm gains, replicated kv weights)
run in ``reduce_dtype`` (``parallel.grad_reduce_dtype`` under mixed precision), like the
data-parallel reductions; activation collectives stay in the compute dtype.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ndtrain.mesh import AxisGroup, Mesh
from ndtrain.parallel.tp import rules
from ndtrain.parallel.tp.layers import SEQ_DIM, VocabParallelEmbedding
from ndtrain.parallel.tp.mixer_plan import check_mixer, localize_heads, mixer_entries
from ndtrain.parallel.tp.mla_plan import mtp_entries
from ndtrain.parallel.tp.moe_plan import ffn_entries, ffn_hidden_sizes
from ndtrain.parallel.tp.plan import TP_SHARD_ATTR, TPContext, apply_plan, llama_tp_plan, padded_vocab

__all__ = ["SEQ_DIM", "TP_SHARD_ATTR", "VocabParallelEmbedding", "apply_tp", "padded_vocab",
           "tp_full_tensor", "tp_local_slice", "tp_specs"]


def tp_specs(model: nn.Module) -> dict[str, tuple[int, int]]:
    """``{fqn: (dim, global size)}`` of the parameters ``apply_tp`` split (tied names included;
    ``(dim, global size, blocks)`` for a fused weight split block by block, ``mixer_plan``);
    recorded on the model, so it survives wrappers that re-create parameters (FSDP)."""
    return getattr(model, "ndtrain_tp_specs", {})


def tp_full_tensor(local: torch.Tensor, spec, group: AxisGroup) -> torch.Tensor:
    """Reassemble a TP-split tensor (a parameter, its gradient or an optimizer moment) on every
    rank of ``group``, without vocabulary padding. ``spec`` is ``(dim, global size)`` (see
    ``tp_specs``), a split parameter, or None / a replicated parameter (returned as it is).
    Collective over ``group`` when the tensor is split."""
    if isinstance(spec, torch.Tensor):
        spec = getattr(spec, TP_SHARD_ATTR, None)
    if spec is None or group.size == 1:
        return local
    dim, size = spec[:2]
    pieces = _all_gather_list(local.contiguous(), group)
    if len(spec) > 2:  # a fused weight split block by block: rank pieces of block 0, then of block 1, ...
        per = [s // group.size for s in spec[2]]
        return torch.cat([blk for blocks in zip(*(p.split(per, dim) for p in pieces)) for blk in blocks], dim)
    full = torch.cat(pieces, dim=dim)
    return full.narrow(dim, 0, size)


def tp_local_slice(full: torch.Tensor, spec, group: AxisGroup) -> torch.Tensor:
    """Inverse of ``tp_full_tensor``: this rank's (zero-padded) slice of a full tensor, in storage
    of its own (contiguous). Not a view: the slice goes on into optimizers, whose fused CPU AdamW
    updates non-contiguous moments wrongly, and a view would keep the whole tensor alive."""
    if spec is None or group.size == 1:
        return full
    dim, size = spec[:2]
    if len(spec) > 2:
        return torch.cat([b.chunk(group.size, dim)[group.rank] for b in full.split(list(spec[2]), dim)], dim)
    per = math.ceil(size / group.size)
    pad = [0, 0] * (full.dim() - 1 - dim) + [0, per * group.size - size]
    return F.pad(full, pad).narrow(dim, group.rank * per, per).clone(memory_format=torch.contiguous_format)


def _all_gather_list(t: torch.Tensor, group: AxisGroup) -> list[torch.Tensor]:
    from ndtrain.parallel.comm import all_gather_into

    out = t.new_empty((group.size,) + tuple(t.shape))
    all_gather_into(out.view(-1), t.reshape(-1), group)
    return list(out.unbind(0))


def _check_blocks(model: nn.Module, tp: int) -> None:
    """Raise NotImplementedError for blocks the plan does not cover, ValueError for heads, groups
    or FFN sizes that do not split over ``tp``."""
    for block in model.layers.values():
        att, ffn = block.attention, block.feed_forward
        ffn_entries("", ffn)  # NotImplementedError for a feed-forward without a plan
        mixer_entries("", att)  # NotImplementedError for a mixer without a plan
        if hasattr(att, "wk"):
            d = att.head_dim
            rules.check_heads(att.wq.weight.shape[0] // d, att.wk.weight.shape[0] // d, tp)
        check_mixer(att, tp)
        for hidden in ffn_hidden_sizes(ffn):  # the dense FFN, or an MoE layer's shared experts
            rules.check_ffn(hidden, tp)


def model_tp_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, object]:
    """``llama_tp_plan`` with the attention slot of each block planned by its token mixer
    (``mixer_plan.mixer_entries``, exact layer names): one table for dense and hybrid models."""
    planned = ("layers.*.attention", "layers.*.feed_forward")  # per layer below (not the norms)
    plan = {k: v for k, v in llama_tp_plan(sequence_parallel).items()
            if k not in planned and not k.startswith(tuple(p + "." for p in planned))}
    for lid, block in model.layers.items():
        plan.update(mixer_entries(f"layers.{lid}.attention", block.attention))
        plan.update(ffn_entries(f"layers.{lid}.feed_forward", block.feed_forward))  # dense or MoE
    # MTP depths' blocks like the layers (mla_plan)
    plan.update(mtp_entries(model, plan, {"attention": mixer_entries, "feed_forward": ffn_entries}))
    return plan


def apply_tp(model: nn.Module, mesh: Mesh, sequence_parallel: bool = False,
             reduce_dtype: torch.dtype | None = None) -> None:
    """Split ``model`` (a ``Transformer`` or a stage of one) over the ``tp`` axis in place, by
    ``model_tp_plan(model, sequence_parallel)`` (each block's token mixer by its own entries).

    Call after ``init_weights`` (slices are cut from the initialised full weights, so every layout
    starts from identical values) and before data parallel. Split parameters carry
    ``ndtrain_shard_axes = ("tp",)`` and ``ndtrain_tp_shard = (dim, global size)``; their names are
    unchanged. ``reduce_dtype``: dtype of this axis's weight-gradient all-reduces
    (``ndtrain.precision.grad_reduce_dtype``; None = the gradient's own dtype).

    Raises ValueError naming the rule when heads, kv heads or the MLP hidden size do not fit
    ``tp``; NotImplementedError for blocks the plan does not cover (MLA). MoE feed-forwards are
    finished after expert parallel by ``moe_plan.apply_moe_tp`` (experts, statistics reducers).
    """
    group = mesh.group("tp")
    if group.size == 1:
        return
    _check_blocks(model, group.size)
    ctx = TPContext(group, sequence_parallel, reduce_dtype, model.cfg.vocab_size)
    # The plan skips what a pipeline stage lacks: a stage without the embedding / head takes /
    # returns the residual stream as it is, under SP split along the sequence, so stages exchange
    # (B, T/tp, C) shards rank by rank (tp times less p2p traffic; a gather at the boundary would
    # sum the replicated incoming gradient tp times).
    apply_plan(model, model_tp_plan(model, sequence_parallel), ctx)
    localize_heads(model, group.size)
    if sequence_parallel:
        model.register_forward_pre_hook(_full_positions, with_kwargs=True)
    model.ndtrain_tp_specs = {n: getattr(p, TP_SHARD_ATTR) for n, p in
                              model.named_parameters(remove_duplicate=False) if hasattr(p, TP_SHARD_ATTR)}


def _full_positions(model, args, kwargs):
    """With SP the residual stream is (B, T/tp, C), but RoPE needs the positions of the whole
    sequence the attention sees: default them to ``arange(T)`` from the tokens."""
    if len(args) > 1 or kwargs.get("positions") is not None or kwargs.get("kv_cache") is not None:
        return None
    kwargs = dict(kwargs, positions=torch.arange(args[0].shape[1], device=args[0].device))
    return args, kwargs
