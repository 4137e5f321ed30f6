"""Tensor-parallel styles: what the plan table (``ndtrain.parallel.tp.plan.TP_PLAN``) does to the
module a row matches.

A style's ``apply(module, parent, ctx)`` returns the replacement module (installed under the same
attribute, so parameter names do not change: ``ndtrain.parallel.tp.layers``,
``ndtrain.parallel.tp.moe_layers``) or None when it changed the module in place. ``TPContext``
carries what every style needs and cuts the slices (``TPContext.shard``: the weight split).
Split parameters carry ``ndtrain_shard_axes = ("tp",)`` and ``ndtrain_tp_shard`` = (dim, global
size) or, for a fused weight split block by block, (dim, global size, blocks).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ndtrain.mesh import AxisGroup
from ndtrain.model.moe_balance import moe_layers
from ndtrain.model.mtp import SHIFT_ATTR, shift_left
from ndtrain.optim import SHARD_AXES_ATTR
from ndtrain.parallel.comm import all_reduce
from ndtrain.parallel.tp.layers import (
    TP_SHARD_ATTR,
    BlockParallelConv1d,
    ColumnParallelLinear,
    RegionInput,
    ReplicatedKVLinear,
    ReplicatedLinear,
    RowParallelLinear,
    SequenceParallelNorm,
    VocabParallelEmbedding,
)
from ndtrain.parallel.tp.moe_layers import SplitExpertsTP, TensorParallelMoE, WholeExpertsTP

TOKEN_DIM = 0  # MoE layers work on token rows (N, C)


def padded_vocab(vocab_size: int, tp: int) -> int:
    """Vocabulary rows after padding to a multiple of ``tp``: ``tp * ceil(V / tp)``."""
    return tp * math.ceil(vocab_size / tp)


@dataclass
class TPContext:
    """The tp group, SP on/off, the weight-gradient reduce dtype (None: the gradient's own),
    the real vocabulary size, ``parallel.expert_tp``; the slices already cut (by id of the full
    Parameter: a tied weight is cut once, shared by both modules) and the steps deferred until
    every row has been applied (``defer``)."""

    group: AxisGroup
    sp: bool
    reduce_dtype: torch.dtype | None
    vocab_size: int
    expert_tp: int = 1
    shards: dict[int, nn.Parameter] = field(default_factory=dict)
    deferred: list = field(default_factory=list)

    def defer(self, fn) -> None:
        self.deferred.append(fn)

    def shard(self, p: nn.Parameter, dim: int, pad_to: int | None = None,
              blocks: tuple[int, ...] | None = None) -> nn.Parameter:
        """This rank's slice of ``p`` along ``dim`` (zero-padded to ``pad_to`` first), tagged.

        ``blocks``: ``dim`` concatenates blocks of these sizes (Mamba-2's ``in_proj`` rows
        [z | x | B | C | dt], a short convolution's [q | k | v] channels); each block is split over
        tp and the slice is this rank's piece of every block. Raises ValueError if the (padded)
        size, or a block, does not split over tp."""
        if id(p) in self.shards:
            return self.shards[id(p)]
        full, tp, rank = p.detach(), self.group.size, self.group.rank
        size = full.shape[dim]
        if pad_to is not None and pad_to > size:
            pad_shape = list(full.shape)
            pad_shape[dim] = pad_to - size
            full = torch.cat([full, full.new_zeros(pad_shape)], dim=dim)
        spec: tuple = (dim, size)
        if blocks is not None:
            if sum(blocks) != size or any(s % tp for s in blocks):
                raise ValueError(f"segments {blocks} of dim {dim} (size {size}) must each be "
                                 f"divisible by tp ({tp}) and add up to the size")
            spec = (dim, size, tuple(blocks))
            piece = torch.cat([blk.chunk(tp, dim)[rank] for blk in full.split(blocks, dim)], dim)
        elif full.shape[dim] % tp:
            raise ValueError(f"size {full.shape[dim]} of dim {dim} is not divisible by tp ({tp})")
        else:
            piece = full.chunk(tp, dim)[rank]
        local = nn.Parameter(piece.clone(), requires_grad=p.requires_grad)
        setattr(local, SHARD_AXES_ATTR, ("tp",))
        setattr(local, TP_SHARD_ATTR, spec)
        self.shards[id(p)] = local
        return local


def _no_bias(lin: nn.Module) -> None:
    if getattr(lin, "bias", None) is not None:
        raise ValueError("tensor parallel linears here have no bias (Llama)")


def _enter_on_input(region: nn.Module, f: RegionInput) -> None:
    """Megatron's f as the region's child ``tp_input``, called on its first positional input."""
    region.add_module("tp_input", f)
    region.register_forward_pre_hook(lambda mod, args: (mod.tp_input(args[0]),) + tuple(args[1:]))


# ---- linears, embedding, head -----------------------------------------------------------------
class Colwise:
    """``nn.Linear`` -> ``ColumnParallelLinear`` (output features split)."""

    def apply(self, lin, parent, ctx: TPContext):
        _no_bias(lin)
        return ColumnParallelLinear(ctx.shard(lin.weight, 0), ctx.group, lin.weight.shape[0], ctx.sp)


class Rowwise:
    """``nn.Linear`` -> ``RowParallelLinear`` (input features split; the output leaves the region)."""

    def apply(self, lin, parent, ctx: TPContext):
        _no_bias(lin)
        return RowParallelLinear(ctx.shard(lin.weight, 1), ctx.group, ctx.sp)


class KVHeads:
    """``wk`` / ``wv`` of a GQA attention (``parent.head_dim``): column-parallel by kv heads when
    ``G % tp == 0``; else (``tp % G == 0``) ``ReplicatedKVLinear`` on kv head ``rank // (tp / G)``,
    the one rank r's query heads belong to."""

    def apply(self, lin, parent, ctx: TPContext):
        tp, d = ctx.group.size, parent.head_dim
        n_kv = lin.weight.shape[0] // d
        if n_kv % tp == 0:
            return Colwise().apply(lin, parent, ctx)
        _no_bias(lin)
        return ReplicatedKVLinear(lin.weight, ctx.group.rank // (tp // n_kv), d, ctx.group, ctx.reduce_dtype)


class VocabEmbedding:
    """``nn.Embedding`` -> ``VocabParallelEmbedding`` (rows split, V padded to a multiple of tp)."""

    def apply(self, emb, parent, ctx: TPContext):
        vp = padded_vocab(ctx.vocab_size, ctx.group.size)
        w = ctx.shard(emb.weight, 0, pad_to=vp)
        return VocabParallelEmbedding(w, ctx.group.rank * (vp // ctx.group.size), ctx.group, ctx.sp, ctx.vocab_size)


class VocabHead:
    """Output head -> ``ColumnParallelLinear`` over the padded vocabulary, a one-layer region of
    its own (its input is the residual stream); a tied head reuses the embedding's slice. The
    logits (B, T, Vp/tp) are never gathered (``ndtrain.parallel.tp.vocab_loss``)."""

    def apply(self, lin, parent, ctx: TPContext):
        _no_bias(lin)
        w = ctx.shard(lin.weight, 0, pad_to=padded_vocab(ctx.vocab_size, ctx.group.size))
        return ColumnParallelLinear(w, ctx.group, ctx.vocab_size, ctx.sp, enter_region=True)


class SPReplicatedLinear:
    """A replicated ``nn.Linear`` on the residual stream: untouched without SP (its inputs and
    output gradients are replicated, so its gradient is whole); with SP a ``ReplicatedLinear``."""

    def apply(self, lin, parent, ctx: TPContext):
        if not ctx.sp:
            return None
        _no_bias(lin)
        return ReplicatedLinear(lin.weight, ctx.group, ctx.reduce_dtype)


class TokenReplicated:
    """A replicated ``nn.Linear`` of an MoE layer, whose tp ranks always route different tokens
    (the router, in float32 at least, and the shared-expert gate): a ``ReplicatedLinear``."""

    def __init__(self, fp32: bool = False):
        self.fp32 = fp32

    def apply(self, lin, parent, ctx: TPContext):
        _no_bias(lin)
        return ReplicatedLinear(lin.weight, ctx.group, ctx.reduce_dtype, fp32=self.fp32)


# ---- regions and norms ------------------------------------------------------------------------
class Region:
    """A tensor-parallel region (attention / MLP half, a linear mixer): Megatron's f on its input;
    the region's row-parallel linear leaves it."""

    def apply(self, region, parent, ctx: TPContext):
        _enter_on_input(region, RegionInput(ctx.group, ctx.sp))


class SPNorm:
    """A norm on the residual stream: untouched without SP; with SP a ``SequenceParallelNorm``
    (each rank normalises its own tokens; the gain's gradient is summed over tp)."""

    def apply(self, norm, parent, ctx: TPContext):
        return SequenceParallelNorm(norm, ctx.group, ctx.reduce_dtype) if ctx.sp else None


class SharedGain:
    """A norm applied per head with one gain shared by the heads (QK-norm, Gated DeltaNet's output
    norm): whole on every rank but seeing only this rank's heads, so its gradient is summed over
    tp (``SequenceParallelNorm``, the wrapper SP uses for the block norms)."""

    def apply(self, norm, parent, ctx: TPContext):
        return SequenceParallelNorm(norm, ctx.group, ctx.reduce_dtype)


class SplitGain:
    """A gain over a head-split width (Mamba-2's gated norm): split by channel like the heads. The
    norm is per B / C group and every group lives on one rank, so it stays local and exact."""

    def apply(self, norm, parent, ctx: TPContext):
        norm.weight = ctx.shard(norm.weight, 0)
        norm.groups = norm.groups // ctx.group.size


# ---- token mixers -----------------------------------------------------------------------------
def gdn_conv_blocks(m) -> tuple[int, ...]:
    """Gated DeltaNet's short-convolution channels [q | k | v]."""
    return (m.key_dim, m.key_dim, m.value_dim)


def mamba_proj_blocks(m) -> tuple[int, ...]:
    """Mamba-2's ``in_proj`` rows [z | x | B | C | dt]."""
    gn = m.n_groups * m.n_state
    return (m.d_inner, m.d_inner, gn, gn, m.n_heads)


def mamba_conv_blocks(m) -> tuple[int, ...]:
    """Mamba-2's short-convolution channels [x | B | C]."""
    gn = m.n_groups * m.n_state
    return (m.d_inner, gn, gn)


class BlockColwise:
    """A fused ``nn.Linear`` whose output rows are blocks of per-head quantities: each block split
    over tp (``ColumnParallelLinear`` on this rank's piece of every block; ``blocks(parent)``)."""

    def __init__(self, blocks):
        self.blocks = blocks

    def apply(self, lin, parent, ctx: TPContext):
        _no_bias(lin)
        w = ctx.shard(lin.weight, 0, blocks=self.blocks(parent))
        return ColumnParallelLinear(w, ctx.group, lin.weight.shape[0], ctx.sp)


class BlockConv:
    """A depthwise short convolution over blocks of per-head channels -> ``BlockParallelConv1d``
    (weight (Ch, 1, W) and bias split block by block; ``blocks(parent)``)."""

    def __init__(self, blocks):
        self.blocks = blocks

    def apply(self, conv, parent, ctx: TPContext):
        blocks = self.blocks(parent)
        bias = ctx.shard(conv.bias, 0, blocks=blocks) if conv.bias is not None else None
        return BlockParallelConv1d(ctx.shard(conv.weight, 0, blocks=blocks), bias, ctx.group, blocks)


class HeadParams:
    """A linear mixer: the region's f, its own per-head vectors (``names``: ``A_log``,
    ``dt_bias``, Mamba-2's ``D``) split by head and, once every row is applied (its fused weights
    are cut by the global counts), the per-rank counts its forward reads (``counts``) divided by tp."""

    def __init__(self, names: tuple[str, ...], counts: tuple[str, ...]):
        self.names, self.counts = names, counts

    def apply(self, mixer, parent, ctx: TPContext):
        note = f"split by head: {', '.join(self.names)}"
        _enter_on_input(mixer, RegionInput(ctx.group, ctx.sp, note=note))
        for n in self.names:
            setattr(mixer, n, ctx.shard(getattr(mixer, n), 0))
        tp = ctx.group.size

        def localize():
            for c in self.counts:
                setattr(mixer, c, getattr(mixer, c) // tp)

        ctx.defer(localize)


class SparseRegion:
    """DSA: the region's f, and the indexer KL target's head sum completed over tp (an all-reduce
    of the detached (B, T, k) sum; no gradient flows through it)."""

    def apply(self, mixer, parent, ctx: TPContext):
        Region().apply(mixer, parent, ctx)
        group = ctx.group

        def reduce_heads(p):
            p = p.contiguous().clone()
            all_reduce(p, group)
            return p

        mixer.reduce_heads = reduce_heads


class MLARegion:
    """DeepSeek MLA: Megatron's f as the mixer's ``enter_heads`` hook (between the replicated
    latent path and the per-head up-projections; child ``tp_input``). Raises ValueError when the
    heads do not split over tp."""

    def apply(self, mla, parent, ctx: TPContext):
        heads = mla.wkv_b.weight.shape[0] // (mla.nope_dim + mla.v_dim)
        if heads % ctx.group.size:
            raise ValueError(f"MLA heads ({heads}) are not divisible by tp ({ctx.group.size})")
        mla.add_module("tp_input", RegionInput(ctx.group, ctx.sp))
        mla.__dict__["enter_heads"] = mla.tp_input  # shadows the method: the model's hook contract


class MTPShift:
    """The ``mtp`` ModuleDict: with SP, or when its blocks hold MoE layers (each tp rank routes
    1/tp of the T positions, which T - k need not split into), give the model the full-length
    ``mtp_shift`` hook; the padded tail is masked out of the MoE layers."""

    def apply(self, mtp, parent, ctx: TPContext):
        if (ctx.sp or moe_layers(mtp)) and getattr(parent, SHIFT_ATTR, None) is None:
            setattr(parent, SHIFT_ATTR, shift_left)


# ---- MoE --------------------------------------------------------------------------------------
class MoELayer:
    """An ``MoE`` feed-forward -> ``TensorParallelMoE`` (its tp ranks route different tokens)."""

    def apply(self, moe, parent, ctx: TPContext):
        return TensorParallelMoE(moe, ctx.group, ctx.sp)


class TokenRegion:
    """The shared experts' f: all-gather the (N_local, C) token rows of the tp ranks."""

    def apply(self, ffn, parent, ctx: TPContext):
        _enter_on_input(ffn, RegionInput(ctx.group, True, TOKEN_DIM))


class TokenRowwise:
    """The shared experts' w2: row-parallel, partial outputs reduce-scattered back to token rows."""

    def apply(self, lin, parent, ctx: TPContext):
        _no_bias(lin)
        return RowParallelLinear(ctx.shard(lin.weight, 1), ctx.group, True, TOKEN_DIM)


class Experts:
    """The routed experts (after expert parallel's cut): ``SplitExpertsTP`` (each expert's hidden
    F split over tp) when ``parallel.expert_tp`` = tp, else ``WholeExpertsTP``; left as they are
    on a folded expert mesh (``folded`` set by ``ndtrain.parallel.ep.expert_parallel.apply_ep``)."""

    def apply(self, experts, parent, ctx: TPContext):
        if getattr(experts, "folded", False):  # the folded expert mesh: expert parallel placed them
            return experts
        cls = SplitExpertsTP if ctx.expert_tp > 1 else WholeExpertsTP
        return cls(experts, ctx.group, ctx.reduce_dtype)
