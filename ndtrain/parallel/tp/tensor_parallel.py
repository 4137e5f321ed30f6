"""Tensor parallel (Megatron-LM, Shoeybi et al. 2019) with optional sequence parallel (Korthikanti
et al. 2022), applied from outside to a single-device ``Transformer``: ``apply_tp``, and the
helpers that rebuild whole tensors from the splits (checkpoints, HF export, the gathered model).

What goes where is the plan table ``ndtrain.parallel.tp.plan.TP_PLAN`` (module-name pattern ->
style, ``ndtrain.parallel.tp.styles``); each style installs a visible module
(``ndtrain.parallel.tp.layers``, ``ndtrain.parallel.tp.moe_layers``) owning the parameter under
the same name, so ``print(model)`` shows every layer's sharding and state-dict keys do not change.
The model code stays single-device: it reads head counts from weight shapes (the linear mixers'
per-rank counts are set once by their style).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ndtrain.mesh import AxisGroup, Mesh
from ndtrain.mixer_spec import non_softmax_mixers
from ndtrain.parallel.tp import rules
from ndtrain.parallel.tp.layers import SEQ_DIM, TP_SHARD_ATTR, VocabParallelEmbedding
from ndtrain.parallel.tp.plan import FFN_KINDS, MIXER_KINDS, TP_PLAN, apply_plan, slot_kind
from ndtrain.parallel.tp.styles import TPContext, padded_vocab

__all__ = ["SEQ_DIM", "TP_SHARD_ATTR", "VocabParallelEmbedding", "apply_tp", "padded_vocab",
           "tp_full_tensor", "tp_local_slice", "tp_specs"]


def tp_specs(model: nn.Module) -> dict[str, tuple[int, int]]:
    """``{fqn: (dim, global size)}`` of the parameters ``apply_tp`` split (tied names included;
    ``(dim, global size, blocks)`` for a fused weight split block by block);
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
    """Raise NotImplementedError for blocks the plan does not cover, ValueError (``ConfigError``)
    for heads, groups or FFN sizes that do not split over ``tp`` (``ndtrain.parallel.tp.rules``)."""
    for block in model.layers.values():
        att, ffn = block.attention, block.feed_forward
        if slot_kind(att, MIXER_KINDS) is None:
            raise NotImplementedError(f"tensor parallel has no plan for the token mixer {type(att).__name__}")
        if ffn is not None and slot_kind(ffn, FFN_KINDS) is None:
            raise NotImplementedError(f"tensor parallel supports FeedForward and MoE blocks, not {type(ffn).__name__}")
        if hasattr(att, "wk"):
            d = att.head_dim
            rules.check_heads(att.wq.weight.shape[0] // d, att.wk.weight.shape[0] // d, tp)
        dense = ffn if slot_kind(ffn, FFN_KINDS) == "dense" else getattr(ffn, "shared", None)
        if dense is not None:  # the dense FFN, or an MoE layer's shared experts
            rules.check_ffn(dense.w1.weight.shape[0], tp)
    rules.check_mixer_heads(tp, non_softmax_mixers(model.cfg), model.cfg)


def apply_tp(model: nn.Module, mesh: Mesh, sequence_parallel: bool = False,
             reduce_dtype: torch.dtype | None = None, expert_tp: int = 1) -> None:
    """Split ``model`` (a ``Transformer`` or a stage of one) over the ``tp`` axis in place, by
    ``TP_PLAN``.

    Call after ``init_weights`` (slices are cut from the initialised full weights, so every layout
    starts from identical values), after expert parallel has cut the experts (the expert rows
    split what this rank holds) and before data parallel. Split parameters carry
    ``ndtrain_shard_axes = ("tp",)`` (experts: ``("ep", "tp")``) and ``ndtrain_tp_shard = (dim,
    global size[, blocks])``, recorded in ``tp_specs``; their names are unchanged.
    ``reduce_dtype``: dtype of this axis's weight-gradient all-reduces
    (``ndtrain.precision.grad_reduce_dtype``; None = the gradient's own dtype). ``expert_tp``:
    ``parallel.expert_tp`` (1: whole experts; tp: each expert's hidden split).

    Raises ValueError naming the rule when heads, kv heads, groups or hidden sizes do not fit
    ``tp``; NotImplementedError for blocks the plan does not cover.
    """
    group = mesh.group("tp")
    if group.size == 1:
        return
    _check_blocks(model, group.size)
    ctx = TPContext(group, sequence_parallel, reduce_dtype, model.cfg.vocab_size, expert_tp)
    # The plan skips what a pipeline stage lacks: a stage without the embedding / head takes /
    # returns the residual stream as it is, under SP split along the sequence, so stages exchange
    # (B, T/tp, C) shards rank by rank (tp times less p2p traffic; a gather at the boundary would
    # sum the replicated incoming gradient tp times).
    apply_plan(model, TP_PLAN, ctx)
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
