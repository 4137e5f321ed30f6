"""Tensor-parallel plans: a table ``{module-name pattern: style}`` per model family, in the manner of
torchtitan's ``parallelize_module`` plans, and the loop that applies one.

A pattern is a module name with ``*`` standing for one name component (``layers.*.attention.wq``).
A style turns the matched module into its tensor-parallel form (``ndtrain.parallel.tp.layers``),
returning the replacement (installed under the same attribute, so parameter names do not change)
or None when it modified the module in place. Modules a plan names but the model lacks (a pipeline
stage without the embedding or head) are skipped.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from ndtrain.mesh import AxisGroup
from ndtrain.optim import SHARD_AXES_ATTR
from ndtrain.parallel.tp.layers import (
    ColumnParallelLinear,
    RegionInput,
    ReplicatedKVLinear,
    RowParallelLinear,
    SequenceParallelNorm,
    VocabParallelEmbedding,
)

TP_SHARD_ATTR = "ndtrain_tp_shard"  # (dim, global size before padding[, segments]) on split params


def padded_vocab(vocab_size: int, tp: int) -> int:
    """Vocabulary rows after padding to a multiple of ``tp``: ``tp * ceil(V / tp)``."""
    return tp * math.ceil(vocab_size / tp)


@dataclass
class TPContext:
    """What every style needs: the tp group, SP on/off, the weight-gradient reduce dtype (None:
    the gradient's dtype), the real vocabulary size, and the slices already cut (by id of the
    full Parameter), so a tied weight is cut once and shared by both of its modules."""

    group: AxisGroup
    sp: bool
    reduce_dtype: torch.dtype | None
    vocab_size: int
    shards: dict[int, nn.Parameter] = field(default_factory=dict)

    def shard(self, p: nn.Parameter, dim: int, pad_to: int | None = None,
              segments: tuple[int, ...] | None = None) -> nn.Parameter:
        """This rank's slice of ``p`` along ``dim`` (zero-padded to ``pad_to`` first), tagged with
        ``ndtrain_shard_axes = ("tp",)`` and ``ndtrain_tp_shard = (dim, global size)``.

        ``segments``: ``p`` is a fused weight whose ``dim`` concatenates blocks of these sizes
        (Mamba-2's ``in_proj`` rows [z | x | B | C | dt], a short convolution's [q | k | v]
        channels); each block is split over tp separately and the local slice is the concatenation
        of this rank's piece of every block; the tag is then ``(dim, global size, segments)``.
        Raises ValueError if the (padded) size, or a segment, does not split over tp."""
        if id(p) in self.shards:
            return self.shards[id(p)]
        full, group = p.detach(), self.group
        global_size = full.shape[dim]
        if pad_to is not None and pad_to > global_size:
            pad_shape = list(full.shape)
            pad_shape[dim] = pad_to - global_size
            full = torch.cat([full, full.new_zeros(pad_shape)], dim=dim)
        spec: tuple = (dim, global_size)
        if segments is not None:
            if sum(segments) != global_size or any(s % group.size for s in segments):
                raise ValueError(f"segments {segments} of dim {dim} (size {global_size}) must each be "
                                 f"divisible by tp ({group.size}) and add up to the size")
            spec = (dim, global_size, tuple(segments))
            piece = torch.cat([blk.chunk(group.size, dim)[group.rank] for blk in full.split(segments, dim)], dim)
        elif full.shape[dim] % group.size:
            raise ValueError(f"size {full.shape[dim]} of dim {dim} is not divisible by tp ({group.size})")
        else:
            piece = full.chunk(group.size, dim)[group.rank]
        local = nn.Parameter(piece.clone(), requires_grad=p.requires_grad)
        setattr(local, SHARD_AXES_ATTR, ("tp",))
        setattr(local, TP_SHARD_ATTR, spec)
        self.shards[id(p)] = local
        return local


def _no_bias(lin: nn.Module) -> None:
    if getattr(lin, "bias", None) is not None:
        raise ValueError("tensor parallel linears here have no bias (Llama)")


class Colwise:
    """``nn.Linear`` -> ``ColumnParallelLinear`` (output features split)."""

    def apply(self, lin: nn.Module, parent: nn.Module, ctx: TPContext) -> nn.Module:
        _no_bias(lin)
        return ColumnParallelLinear(ctx.shard(lin.weight, 0), ctx.group, lin.weight.shape[0], ctx.sp)


class Rowwise:
    """``nn.Linear`` -> ``RowParallelLinear`` (input features split; output leaves the region)."""

    def apply(self, lin: nn.Module, parent: nn.Module, ctx: TPContext) -> nn.Module:
        _no_bias(lin)
        return RowParallelLinear(ctx.shard(lin.weight, 1), ctx.group, ctx.sp)


class KVHeads:
    """``wk`` / ``wv`` of a GQA attention (``parent.head_dim``): column-parallel by kv heads when
    ``G % tp == 0``; else (``tp % G == 0``) ``ReplicatedKVLinear`` on kv head ``rank // (tp / G)``,
    the one rank r's query heads belong to."""

    def apply(self, lin: nn.Module, parent: nn.Module, ctx: TPContext) -> nn.Module:
        tp, d = ctx.group.size, parent.head_dim
        n_kv = lin.weight.shape[0] // d
        if n_kv % tp == 0:
            return Colwise().apply(lin, parent, ctx)
        _no_bias(lin)
        return ReplicatedKVLinear(lin.weight, ctx.group.rank // (tp // n_kv), d, ctx.group, ctx.reduce_dtype)


class VocabEmbedding:
    """``nn.Embedding`` -> ``VocabParallelEmbedding`` (rows split, V padded to a multiple of tp)."""

    def apply(self, emb: nn.Module, parent: nn.Module, ctx: TPContext) -> nn.Module:
        vp = padded_vocab(ctx.vocab_size, ctx.group.size)
        w = ctx.shard(emb.weight, 0, pad_to=vp)
        return VocabParallelEmbedding(w, ctx.group.rank * (vp // ctx.group.size), ctx.group, ctx.sp,
                                      ctx.vocab_size)


class VocabHead:
    """Output head ``nn.Linear`` -> ``ColumnParallelLinear`` over the padded vocabulary, entering
    its own one-layer region (its input is the residual stream; with SP split along T). A tied
    head reuses the embedding's slice. Logits (B, T, Vp/tp) are never gathered (see
    ``ndtrain.parallel.tp.vocab_loss``)."""

    def apply(self, lin: nn.Module, parent: nn.Module, ctx: TPContext) -> nn.Module:
        _no_bias(lin)
        w = ctx.shard(lin.weight, 0, pad_to=padded_vocab(ctx.vocab_size, ctx.group.size))
        return ColumnParallelLinear(w, ctx.group, ctx.vocab_size, ctx.sp, enter_region=True)


class Region:
    """A tensor-parallel region (attention or MLP half): registers ``RegionInput`` as the child
    ``tp_input`` and a forward pre-hook that passes the first positional input through it. The
    region's output is left by its row-parallel linear."""

    def apply(self, region: nn.Module, parent: nn.Module, ctx: TPContext) -> None:
        region.add_module("tp_input", RegionInput(ctx.group, ctx.sp))
        region.register_forward_pre_hook(lambda mod, args: (mod.tp_input(args[0]),) + tuple(args[1:]))


class SequenceParallel:
    """A norm under SP -> ``SequenceParallelNorm`` (gain gradient summed over tp)."""

    def apply(self, norm: nn.Module, parent: nn.Module, ctx: TPContext) -> nn.Module:
        return SequenceParallelNorm(norm, ctx.group, ctx.reduce_dtype)


def llama_tp_plan(sequence_parallel: bool) -> dict[str, object]:
    """The plan of ``ndtrain.model.Transformer`` with ``Attention`` + ``FeedForward`` blocks
    (Megatron-LM's split): q / k / v and the MLP's w1 / w3 column-parallel, wo / w2 row-parallel,
    vocabulary-parallel embedding and head; with SP the norms become ``SequenceParallelNorm``."""
    plan: dict[str, object] = {
        "tok_embeddings": VocabEmbedding(),
        "layers.*.attention": Region(),
        "layers.*.attention.wq": Colwise(),
        "layers.*.attention.wk": KVHeads(),
        "layers.*.attention.wv": KVHeads(),
        "layers.*.attention.wo": Rowwise(),
        "layers.*.feed_forward": Region(),
        "layers.*.feed_forward.w1": Colwise(),
        "layers.*.feed_forward.w3": Colwise(),
        "layers.*.feed_forward.w2": Rowwise(),
        "output": VocabHead(),
    }
    if sequence_parallel:
        plan.update({"layers.*.attention_norm": SequenceParallel(), "layers.*.ffn_norm": SequenceParallel(),
                     "norm": SequenceParallel()})
    return plan


def _regex(pattern: str) -> re.Pattern:
    return re.compile("^" + r"\.".join("[^.]+" if part == "*" else re.escape(part)
                                       for part in pattern.split(".")) + "$")


def apply_plan(model: nn.Module, plan: dict[str, object], ctx: TPContext) -> list[str]:
    """Apply ``plan`` to ``model`` in place, in module registration order (so a tied embedding is
    cut before its head). Returns the names of the modules a style was applied to; a module
    matching two patterns raises ValueError."""
    compiled = [(_regex(pat), style) for pat, style in plan.items()]
    applied = []
    for name, mod in list(model.named_modules()):  # snapshot: styles replace modules
        styles = [style for rx, style in compiled if rx.match(name)]
        if not styles:
            continue
        if len(styles) > 1:
            raise ValueError(f"module {name} matches more than one tensor-parallel plan entry")
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        new = styles[0].apply(mod, parent, ctx)
        if new is not None:
            setattr(parent, attr, new)
        applied.append(name)
    return applied
