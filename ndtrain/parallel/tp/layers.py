"""Tensor / sequence parallel layers (Megatron-LM, Shoeybi et al. 2019; sequence parallel,
Korthikanti et al. 2022): the modules ``apply_tp`` installs in place of a single-device model's
``nn.Linear`` / ``nn.Embedding`` / norm modules, so ``print(model)`` shows every layer's sharding.

Each replacement owns its parameter under the replaced module's attribute name (``weight``), so
parameter names and state-dict keys do not change (``layers.0.attention.wq.weight`` stays). Every
module reads its weight from its own ``_parameters`` at forward time, so data-parallel wrappers
that swap parameters in place (ZeRO-3 gathers) keep working.

Shapes: activations are (B, T, C); under sequence parallel the residual stream is (B, T/tp, C)
(split along ``SEQ_DIM``), and a region's input is gathered to (B, T, C).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from ndtrain.mesh import AxisGroup
from ndtrain.parallel.tp.collectives import (
    CopyToTP,
    CopyWeightToTP,
    GatherFromSequence,
    ReduceFromTP,
    ReduceScatterToSequence,
)
from ndtrain.parallel.tp.sp_linear import linear, tag_gathered

SEQ_DIM = 1  # activations are (B, T, C)
TP_SHARD_ATTR = "ndtrain_tp_shard"  # (dim, global size before padding[, blocks]) on split params


def _enter(x: torch.Tensor, group: AxisGroup, sp: bool, dim: int = SEQ_DIM) -> torch.Tensor:
    """Megatron's f: the replicated (or, with SP, gathered along ``dim``) input of a region."""
    if not sp:
        return CopyToTP.apply(x, group)
    return tag_gathered(GatherFromSequence.apply(x, group, dim), x, group, dim)


def _leave(y: torch.Tensor, group: AxisGroup, sp: bool, dim: int = SEQ_DIM) -> torch.Tensor:
    """Megatron's g: sum the region's partial outputs (with SP: reduce-scattered along ``dim``)."""
    return ReduceScatterToSequence.apply(y, group, dim) if sp else ReduceFromTP.apply(y, group)


def _f_repr(sp: bool) -> str:
    return "all-gather T" if sp else "copy (bwd all-reduce)"


class RegionInput(nn.Module):
    """Megatron's f at the input of a tensor-parallel region (an attention or MLP half).

    No parameters. ``apply_tp`` registers it as the region's child ``tp_input`` (so the model
    prints it) and calls it from a forward pre-hook on the region's first positional input, since
    the region's own ``forward`` is model code that must not know about tp. One f per region, not
    one per column-parallel linear: wq / wk / wv share one gather (or one backward all-reduce).
    fwd: identity, or all-gather along T (SP); bwd: all-reduce, or reduce-scatter along T (SP).
    ``dim``: the gathered dim (the MoE shared expert gathers token rows, dim 0 of (N, C)); ``note``:
    what else the region's style split in place (a linear mixer's per-head vectors), for ``repr``.
    """

    def __init__(self, group: AxisGroup, sp: bool, dim: int = SEQ_DIM, note: str = ""):
        super().__init__()
        self.group, self.sp, self.dim, self.note = group, sp, dim, note

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _enter(x, self.group, self.sp, self.dim)

    def extra_repr(self) -> str:
        return f"tp={self.group.size}, {_f_repr(self.sp)}" + (f", {self.note}" if self.note else "")


class _LinearShard(nn.Module):
    """A bias-free linear's local weight (out_local, in_local) and its feature counts."""

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]


class ColumnParallelLinear(_LinearShard):
    """Bias-free linear holding rows ``[r*out/tp, (r+1)*out/tp)`` of the full (out, in) weight.

    x (..., in) -> (..., out_local). The input must already be whole on every tp rank: a region's
    ``RegionInput`` does that, or this layer itself when ``enter_region`` (the output head, a
    region of one layer). ``global_out`` is the full output size (vocabulary V for the head, whose
    weight is padded with zero rows to ``tp * ceil(V / tp)``); it is only shown by ``repr``.
    """

    def __init__(self, weight: nn.Parameter, group: AxisGroup, global_out: int, sp: bool = False,
                 enter_region: bool = False):
        super().__init__()
        self.weight = weight  # (out_local, in)
        self.group, self.global_out, self.sp, self.enter_region = group, global_out, sp, enter_region

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.enter_region:
            x = _enter(x, self.group, self.sp)
        return linear(x, self.weight)  # under SP saves the T/tp shard, not the gathered input

    def extra_repr(self) -> str:
        padded = self.out_features * self.group.size
        pad = f" (padded from {self.global_out})" if padded != self.global_out else ""
        s = f"in={self.in_features}, out={padded}/tp{self.group.size}{pad}, sp={self.sp}"
        return s + (f", input: {_f_repr(self.sp)}" if self.enter_region else "")


class RowParallelLinear(_LinearShard):
    """Bias-free linear holding columns ``[r*in/tp, (r+1)*in/tp)`` of the full (out, in) weight;
    its output leaves the region (Megatron's g): all-reduce, or with SP reduce-scatter along T.

    x (B, T, in_local) -> (B, T, out), or (B, T/tp, out) with SP (``dim``: the scattered dim).
    """

    # A split backward's W pass (pp zero_bubble / dualpipev, which set the flag) differentiates
    # ``weight_grad_output``, the partial output before g: from g's output it would repeat g's
    # backward (under SP an all-gather) that B already ran.
    keep_weight_grad_output = False
    weight_grad_output: torch.Tensor | None = None

    def __init__(self, weight: nn.Parameter, group: AxisGroup, sp: bool = False, dim: int = SEQ_DIM):
        super().__init__()
        self.weight = weight  # (out, in_local)
        self.group, self.sp, self.dim = group, sp, dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)  # partial sums over tp
        if self.keep_weight_grad_output:
            self.weight_grad_output = y
        return _leave(y, self.group, self.sp, self.dim)

    def extra_repr(self) -> str:
        out = "reduce-scatter T" if self.sp else "all-reduce"
        return (f"in={self.in_features * self.group.size}/tp{self.group.size}, out={self.out_features}, "
                f"sp={self.sp}, output: {out}")


class ReplicatedKVLinear(_LinearShard):
    """Key or value projection with fewer kv heads than tp ranks (``tp % G == 0``): every rank
    keeps the whole (G*D, C) weight and projects only kv head ``head``, the one its query heads
    belong to. The weight passes through ``CopyWeightToTP``, so each kv head's gradient is the sum
    over the ranks that used it, reduced in ``reduce_dtype``. x (..., C) -> (..., D).
    """

    def __init__(self, weight: nn.Parameter, head: int, head_dim: int, group: AxisGroup,
                 reduce_dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = weight  # (G*D, C), whole
        self.head, self.head_dim, self.group, self.reduce_dtype = head, head_dim, group, reduce_dtype

    @property
    def out_features(self) -> int:
        return self.head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = CopyWeightToTP.apply(self.weight, self.group, self.reduce_dtype)
        return linear(x, w[self.head * self.head_dim:(self.head + 1) * self.head_dim])  # (..., D)

    def extra_repr(self) -> str:
        g = self.weight.shape[0] // self.head_dim
        return (f"in={self.in_features}, out={self.head_dim} (kv head {self.head} of {g}, whole weight), "
                f"grad: all-reduce over tp{self.group.size}")


class ReplicatedLinear(nn.Module):
    """A bias-free linear kept whole on every tp rank but applied to this rank's tokens only
    (sequence parallel; an MoE layer's router and shared-expert gate): the weight passes through
    ``CopyWeightToTP`` (fwd identity, bwd all-reduce over tp in ``reduce_dtype``), so its gradient
    covers every token. ``fp32``: computed in float32 at least (the router; float64 stays).
    x (..., in) -> (..., out)."""

    def __init__(self, weight: nn.Parameter, group: AxisGroup, reduce_dtype: torch.dtype | None = None,
                 fp32: bool = False):
        super().__init__()
        self.weight = weight  # (out, in), whole
        self.group, self.reduce_dtype, self.fp32 = group, reduce_dtype, fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = CopyWeightToTP.apply(self.weight, self.group, self.reduce_dtype)
        if self.fp32:
            dt = torch.promote_types(w.dtype, torch.float32)
            x, w = x.to(dt), w.to(dt)
        return F.linear(x, w)

    def extra_repr(self) -> str:
        out, inp = self.weight.shape
        fp32 = ", fp32" if self.fp32 else ""
        return f"in={inp}, out={out} (whole){fp32}, weight grad: all-reduce over tp{self.group.size}"


class BlockParallelConv1d(nn.Conv1d):
    """A depthwise short convolution over blocks of per-head channels ([q | k | v] of Gated
    DeltaNet, [x | B | C] of Mamba-2; ``blocks``: the global block sizes), this rank holding its
    1/tp of every block: weight (Ch_local, 1, W), bias (Ch_local,) or None. Each channel is
    convolved alone, so nothing comes from other ranks; the mixers read ``weight`` / ``bias``."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, group: AxisGroup, blocks: tuple[int, ...]):
        ch, _, width = weight.shape
        with torch.device("meta"):  # placeholders only: replaced by the slices below
            super().__init__(ch, ch, width, groups=ch, bias=bias is not None)
        self.weight, self.bias = weight, bias
        self.group, self.blocks = group, tuple(blocks)

    def extra_repr(self) -> str:
        tp = self.group.size
        return (f"channels={sum(self.blocks)}/tp{tp} in blocks {list(self.blocks)}, "
                f"kernel={self.kernel_size[0]}, depthwise")


class SequenceParallelNorm(nn.Module):
    """A norm whose gain is replicated over tp but applied to different data on each rank: under
    SP to this rank's tokens only; in a head-split mixer to this rank's heads only (a per-head norm
    whose gain is shared by the heads: Gated DeltaNet's output norm, QK-norm). The gain passes
    through ``CopyWeightToTP`` so its gradient is summed over tp (in ``reduce_dtype``). The
    computation is the wrapped norm's own ``forward`` (run with ``torch.func.functional_call`` on
    the summed gain, extra arguments such as a gate passed on), so any norm with a ``weight`` works.

    The wrapped norm is kept unregistered, with a placeholder parameter (a recipe only): this
    module owns ``weight``, keeping the state-dict key ``<name>.weight``. Shapes: x (..., C) -> (..., C).
    """

    def __init__(self, norm: nn.Module, group: AxisGroup, reduce_dtype: torch.dtype | None = None):
        super().__init__()
        names = [n for n, _ in norm.named_parameters()]
        if names != ["weight"]:
            raise NotImplementedError(f"sequence parallel norms need exactly one parameter `weight`, "
                                      f"{type(norm).__name__} has {names}")
        self.weight = norm.weight  # (C,)
        # The wrapped norm keeps a storage-less meta placeholder (its repr shows the shape; the
        # forward passes this module's weight) rather than a second reference that a data-parallel
        # wrapper swapping ``self.weight`` would leave stale.
        norm._parameters["weight"] = nn.Parameter(torch.empty_like(norm.weight, device="meta"),
                                                  requires_grad=False)
        self.__dict__["norm"] = norm  # not a child: its parameter lives here, under the same name
        self.group, self.reduce_dtype = group, reduce_dtype

    def forward(self, x: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        w = CopyWeightToTP.apply(self.weight, self.group, self.reduce_dtype)
        return functional_call(self.norm, {"weight": w}, (x, *args))

    def extra_repr(self) -> str:
        return f"{self.norm!r}, weight grad: all-reduce over tp{self.group.size}"


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (vocabulary) are split over ``tp``; ids outside this rank's range give
    zeros, and the partial rows are summed (``ReduceFromTP``) or, with SP, reduce-scattered along
    the sequence. Shapes: tokens (B, T) -> (B, T, C), or (B, T/tp, C) with SP.
    """

    def __init__(self, weight: nn.Parameter, vocab_start: int, group: AxisGroup, sp: bool,
                 vocab_size: int | None = None):
        super().__init__()
        self.weight = weight  # (Vp / tp, C), keeps the name ``tok_embeddings.weight``
        self.vocab_start, self.group, self.sp = vocab_start, group, sp
        self.vocab_size = vocab_size

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])  # (B, T)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)  # (B, T, C)
        h = h.masked_fill(outside.unsqueeze(-1), 0.0)
        return _leave(h, self.group, self.sp)

    def extra_repr(self) -> str:
        rows, tp = self.weight.shape[0], self.group.size
        v = f", vocab={self.vocab_size}" if self.vocab_size is not None else ""
        return (f"rows={rows * tp}/tp{tp} [{self.vocab_start}, {self.vocab_start + rows}){v}, "
                f"dim={self.weight.shape[1]}, sp={self.sp}")
