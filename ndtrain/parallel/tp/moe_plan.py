"""Mixture-of-Experts feed-forwards under tensor parallel (Megatron-Core's MoE layout: Shoeybi et al.
2019, Korthikanti et al. 2022; expert tensor parallel as in Megatron-Core's ``expert_tensor_parallel_size``).

Design: **the tp ranks route different tokens**. Every tp rank of an MoE layer handles a 1/tp slice
of the block's tokens along T: with sequence parallel the residual stream already is that slice
(B, T/tp, C); without it the replicated input is sliced on entry (``ScatterToSequence``: fwd split,
bwd all-gather) and the output all-gathered on exit (``GatherToReplicated``: fwd all-gather, bwd
split). No expert work is done twice, and the code path is the same with and without SP.

* **Router** (and the Qwen3-Next shared-expert gate): replicated, run on the local tokens in fp32
  (float64 in a float64 model); every rank routes its tokens exactly as the single process does.
  Their weight gradients are summed over tp (``CopyWeightToTP``).
* **Routed experts**, ``parallel.expert_tp``:

  - ``1`` (Megatron's default): every tp rank keeps whole experts (with ep: its E/ep of them, the
    same block on every tp rank) and runs them on its own tokens (with ep: the tokens its ep peers
    of the same tp index sent). Expert weights are replicated over tp and see different tokens, so
    their gradients are summed over tp (``CopyWeightToTP`` at use: one all-reduce of the expert
    weights per microbatch; folding tp into the expert gradient-reduction group would do it once
    per step and is not implemented).
  - ``tp``: each expert's SwiGLU is split like the dense FFN, w1 / w3 (E, F, C) by rows of F
    (dim 1), w2 (E, C, F) by columns (dim 2). After the ep dispatch (or directly, ep = 1) the tp
    ranks all-gather their expert-sorted token rows (variable sizes: an all-to-all-v), run every
    token through their F/tp slice, and reduce-scatter the partial outputs back to the rank that
    owns each row (Megatron-Core's order: ep all-to-all, then tp all-gather, so the ep traffic is
    not multiplied by tp).
* **Shared experts**: a dense FFN split over tp like the block FFN (w1 / w3 column, w2 row), on the
  token rows (N_local, C): all-gather rows in, reduce-scatter rows out (``RegionInput`` /
  ``RowParallelLinear`` with ``dim = 0``).
* **Statistics**: the aux losses, loads and capacity cover the tp ranks' tokens together: the
  Switch loss's expert counts are summed over tp (then over its scope, ``apply_ep``), the
  per-sequence counts and the capacity decision see whole sequences through a ``SequenceShards``
  that refines cp's chunks into tp pieces (``tp_sequence_shards``), and right after each training
  forward the layer's new ``LoadStats`` and the value of its aux-loss token sum are summed over tp
  (one all-reduce of E + 6 floats), so every tp rank reports and updates the aux-loss-free bias
  from the same global loads; the aux sum's gradient stays that of the rank's own tokens.

Communication per MoE layer and microbatch (bytes of one (B, T, C) activation = A): with SP the
shared expert's all-gather + reduce-scatter (as a dense FFN under SP), nothing else on tp for
``expert_tp = 1``; without SP one more all-gather of A (exit forward, entry backward). With
``expert_tp = tp`` add the row all-gather and reduce-scatter of the k routed copies of each token.

``apply_tp`` installs the router / shared-expert / token-split part through the plan
(``ffn_entries``); ``apply_moe_tp`` does the experts, the reducers and the shards after expert
parallel has cut the experts (``ndtrain.parallel.parallelize``). Parameter names never change;
split expert weights carry ``ndtrain_tp_shard`` = (dim, F) and shard axes (["ep",] "tp").
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ndtrain.mesh import AxisGroup, Mesh
from ndtrain.model.mlp import FeedForward
from ndtrain.model.moe import GroupedExperts, MoE, grouped_mm
from ndtrain.model.moe_capacity import SequenceShards
from ndtrain.optim import SHARD_AXES_ATTR, shard_axes
from ndtrain.parallel import comm
from ndtrain.parallel.ep.collectives import AllToAllV, all_to_all_v
from ndtrain.parallel.tp.collectives import CopyWeightToTP, GatherToReplicated, ScatterToSequence
from ndtrain.parallel.tp.layers import (
    SEQ_DIM,
    RegionInput,
    RowParallelLinear,
    SequenceParallelNorm,
)
from ndtrain.parallel.tp.plan import TP_SHARD_ATTR, Colwise, Region, Rowwise, TPContext

TOKEN_DIM = 0  # the MoE works on token rows (N, C)


class TensorParallelMoE(MoE):
    """An ``MoE`` whose tp ranks route different tokens (module docstring). ``apply_tp`` switches a
    layer's class to this one in place (``MoERegion``), so the module, its ``stats`` and its
    parameters stay the same objects. x (B, T, C), or (B, T/tp, C) under SP -> the same shape.
    Raises ValueError when T does not split over tp."""

    tp_group: AxisGroup
    tp_sp: bool
    tp_reduce_dtype: torch.dtype | None

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        w = CopyWeightToTP.apply(self.router.weight, self.tp_group, self.tp_reduce_dtype)  # (E, C)
        rdt = torch.promote_types(w.dtype, torch.float32)
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.to(rdt), w.to(rdt))  # (N, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.tp_group
        if not self.tp_sp:
            x = ScatterToSequence.apply(x, g, SEQ_DIM)  # (B, T/tp, C)
        valid = self.token_mask  # (B, T) of the cp-local tokens: keep this rank's 1/tp piece along T
        valid = None if valid is None else valid.chunk(g.size, SEQ_DIM)[g.rank]
        mark = _StatsMark(self.stats)
        out = super().forward_tokens(x, valid)
        if self.stats.recorded != mark.recorded:  # a recording training forward (not a recompute)
            self._complete_over_tp(mark)
        return out if self.tp_sp else GatherToReplicated.apply(out, g, SEQ_DIM)

    def _complete_over_tp(self, mark: _StatsMark) -> None:
        """Sum this forward's load statistics and aux value over tp (one all-reduce)."""
        st, aux = self.stats, self.aux_sum
        names = sorted(st.terms)
        base = mark.counts if mark.counts is not None else torch.zeros_like(st.counts)
        scal = [st.dropped - mark.dropped, st.assigned - mark.assigned]
        scal += [st.terms[n] - mark.terms.get(n, 0.0) for n in names]
        scal += [float(aux.detach()) if aux is not None else 0.0]
        packed = torch.cat([st.counts - base, torch.tensor(scal, dtype=torch.float64, device=st.counts.device)])
        comm.all_reduce(packed, self.tp_group)
        e = st.counts.numel()
        st.counts = base + packed[:e]
        st.dropped, st.assigned = mark.dropped + float(packed[e]), mark.assigned + float(packed[e + 1])
        for i, n in enumerate(names):
            st.terms[n] = mark.terms.get(n, 0.0) + float(packed[e + 2 + i])
        if aux is not None:  # value: all tp ranks' tokens; gradient: this rank's own tokens
            self.aux_sum = aux + (packed[-1].to(aux.dtype) - aux.detach())

    def extra_repr(self) -> str:
        entry = "tokens: own T/tp (SP)" if self.tp_sp else "tokens: split T on entry, all-gather on exit"
        return f"tp={self.tp_group.size}, {entry}, router: replicated, grad all-reduce over tp"


class _StatsMark:
    """A ``LoadStats`` snapshot taken before a forward (``record`` replaces, never mutates, counts)."""

    def __init__(self, st):
        self.counts, self.dropped, self.assigned, self.terms = st.counts, st.dropped, st.assigned, dict(st.terms)
        self.recorded = st.recorded


class MoERegion:
    """Plan style of an ``MoE`` feed-forward: switch it to ``TensorParallelMoE`` in place."""

    def apply(self, moe: nn.Module, parent: nn.Module, ctx: TPContext) -> None:
        moe.__class__ = TensorParallelMoE
        moe.tp_group, moe.tp_sp, moe.tp_reduce_dtype = ctx.group, ctx.sp, ctx.reduce_dtype


class TokenRegion:
    """The shared expert's f: all-gather the (N_local, C) token rows of the tp ranks."""

    def apply(self, ffn: nn.Module, parent: nn.Module, ctx: TPContext) -> None:
        ffn.add_module("tp_input", RegionInput(ctx.group, True, TOKEN_DIM))
        ffn.register_forward_pre_hook(lambda mod, args: (mod.tp_input(args[0]),) + tuple(args[1:]))


class TokenRowwise:
    """The shared expert's w2: row-parallel, partial outputs reduce-scattered back to token rows."""

    def apply(self, lin: nn.Module, parent: nn.Module, ctx: TPContext) -> nn.Module:
        return RowParallelLinear(ctx.shard(lin.weight, 1), ctx.group, True, TOKEN_DIM)


class ReplicatedWeight:
    """A replicated one-weight module used on this rank's tokens only (the shared-expert gate):
    its gradient is summed over tp (``SequenceParallelNorm`` runs any such module)."""

    def apply(self, mod: nn.Module, parent: nn.Module, ctx: TPContext) -> nn.Module:
        return SequenceParallelNorm(mod, ctx.group, ctx.reduce_dtype)


def ffn_entries(name: str, ffn: nn.Module | None) -> dict[str, object]:
    """Plan entries (exact names) of the feed-forward ``ffn`` registered at ``name``
    (``layers.<i>.feed_forward``): Megatron's dense split for a ``FeedForward``, the MoE plan above
    for an ``MoE``, nothing for a block without one. Raises NotImplementedError otherwise."""
    if ffn is None:
        return {}
    if isinstance(ffn, FeedForward):
        return {name: Region(), f"{name}.w1": Colwise(), f"{name}.w3": Colwise(), f"{name}.w2": Rowwise()}
    if not isinstance(ffn, MoE):
        raise NotImplementedError(f"tensor parallel supports FeedForward and MoE blocks, not {type(ffn).__name__}")
    out: dict[str, object] = {name: MoERegion()}
    if ffn.shared is not None:
        s = f"{name}.shared"
        out.update({s: TokenRegion(), f"{s}.w1": Colwise(), f"{s}.w3": Colwise(), f"{s}.w2": TokenRowwise()})
    if ffn.shared_gate is not None:
        out[f"{name}.shared_gate"] = ReplicatedWeight()
    return out


def ffn_hidden_sizes(ffn: nn.Module | None) -> list[int]:
    """Hidden sizes that ``ffn_entries`` splits over tp (dense FFN, or the shared experts)."""
    if isinstance(ffn, FeedForward):
        return [ffn.w1.weight.shape[0]]
    if isinstance(ffn, MoE) and ffn.shared is not None:
        return [ffn.shared.w1.weight.shape[0]]
    return []


# ---- routed experts ---------------------------------------------------------------------------
class WholeExpertsTP(GroupedExperts):
    """``parallel.expert_tp = 1``: whole experts on every tp rank, run on this rank's tokens; the
    weights pass through ``CopyWeightToTP`` (gradient summed over tp). xs (M, C), counts (E_l,)."""

    def forward(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w3, w2 = (CopyWeightToTP.apply(getattr(self, n), self.tp_group, self.tp_reduce_dtype)
                      for n in ("w1", "w3", "w2"))
        h = F.silu(grouped_mm(xs, w1, counts, self.impl)) * grouped_mm(xs, w3, counts, self.impl)  # (M, F)
        return grouped_mm(h, w2, counts, self.impl)  # (M, C)


class SplitExpertsTP(GroupedExperts):
    """``parallel.expert_tp = tp``: each expert's hidden F split over tp. xs (M, C) this rank's
    rows sorted by (local) expert, counts (E_l,) -> (M, C) the whole expert outputs of those rows:
    all-gather the tp ranks' rows (variable sizes), run them through the F/tp slice, reduce-scatter
    the partial sums back. Every tp rank must call it (collectives), also with M = 0.

    Under a split backward (``keep_weight_grad_output``, set by the pipeline runtime) the partial
    sums before the reduce-scatter are left in ``weight_grad_output`` for the W pass, which then
    reaches the weights through the local GEMMs only (as ``ep.layers.ExpertParallelExperts``)."""

    keep_weight_grad_output = False
    weight_grad_output: torch.Tensor | None = None

    def forward(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        g, el, m = self.tp_group, counts.numel(), xs.shape[0]
        tp = g.size
        every = torch.empty(tp, el, dtype=counts.dtype, device=counts.device)  # (tp, E_l) rows per rank, expert
        all_to_all_v(every, counts.view(1, el).expand(tp, el).contiguous(), [1] * tp, [1] * tp, g)
        rows = every.sum(1).tolist()  # rows each tp rank holds
        xa = AllToAllV.apply(xs.repeat(tp, 1), rows, [m] * tp, g)  # (R, C), (source, expert) order
        seg = torch.arange(tp * el, device=xs.device).repeat_interleave(every.reshape(-1))  # (R,) s*el + e
        perm = torch.argsort((seg % el) * tp + seg // el, stable=True)  # -> (expert, source) order
        y = super().forward(xa[perm], every.sum(0))  # (R, C) partial sums over F/tp
        if self.keep_weight_grad_output:
            self.weight_grad_output = y
        y = y.new_zeros(y.shape).index_copy(0, perm, y)  # back to (source, expert) order
        return AllToAllV.apply(y, [m] * tp, rows, g).view(tp, m, -1).sum(0)  # (M, C)


_CLASSES: dict[tuple[type, type], type] = {}


def _tp_class(cls: type, compute: type) -> type:
    """``compute`` itself for plain ``GroupedExperts``; for a subclass (``ExpertParallelExperts``,
    whose forward dispatches and then calls ``super().forward`` on the local rows) a class whose MRO
    puts ``compute`` right after it, so the local expert compute is the tp one."""
    if cls is GroupedExperts or issubclass(cls, compute):
        return compute if cls is GroupedExperts else cls
    if (cls, compute) not in _CLASSES:
        def extra_repr(self) -> str:
            split = "hidden split" if compute is SplitExpertsTP else "whole experts, grad all-reduce"
            return f"{cls.extra_repr(self)}, tp{self.tp_group.size}: {split}"

        _CLASSES[(cls, compute)] = type(f"{cls.__name__}TP", (cls, compute), {"extra_repr": extra_repr})
    return _CLASSES[(cls, compute)]


def _split(p: nn.Parameter, dim: int, group: AxisGroup) -> nn.Parameter:
    """This rank's slice of an expert weight along ``dim`` (F), tagged as split over tp."""
    size = p.shape[dim]
    if size % group.size:
        raise ValueError(f"expert hidden size ({size}) is not divisible by tp ({group.size}) (parallel.expert_tp)")
    local = nn.Parameter(p.detach().chunk(group.size, dim)[group.rank].clone(), requires_grad=p.requires_grad)
    setattr(local, SHARD_AXES_ATTR, shard_axes(p) + ("tp",))
    setattr(local, TP_SHARD_ATTR, (dim, size))
    return local


def tp_sequence_shards(base: SequenceShards | None, group: AxisGroup) -> SequenceShards:
    """How each sequence's tokens are spread over the ranks routing them under tp: the cp chunks
    of ``base`` (None: cp = 1, one chunk) each cut into ``s`` pieces so that tp rank t takes the
    t-th contiguous 1/tp of its cp rank's local tokens. Ranks are numbered cp-major (c * tp + t);
    the sum and gather run over tp, then over cp."""
    tp = group.size
    cp_chunks, cp_rank = (base.chunks, base.rank) if base is not None else (((0,),), 0)
    nl = len(cp_chunks[0])
    s = tp // math.gcd(nl, tp)
    per = nl * s // tp

    def pieces(ids):
        return [j * s + i for j in ids for i in range(s)]

    chunks = tuple(tuple(pieces(ids)[t * per:(t + 1) * per]) for ids in cp_chunks for t in range(tp))

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        comm.all_reduce(t, group)
        return base.all_reduce(t) if base is not None else t

    def all_gather(t: torch.Tensor) -> torch.Tensor:
        out = t.new_empty((tp,) + tuple(t.shape))  # (tp, ...)
        comm.all_gather_into(out.view(-1), t.contiguous().view(-1), group)
        return base.all_gather(out).flatten(0, 1) if base is not None else out  # (cp * tp, ...)

    return SequenceShards(cp_rank * tp + group.rank, chunks, all_reduce, all_gather)


def apply_moe_tp(model: nn.Module, mesh: Mesh, expert_tp: int, reduce_dtype: torch.dtype | None = None) -> None:
    """Finish the MoE layers of a tp model after expert parallel (in place): the experts become
    ``WholeExpertsTP`` (``expert_tp`` 1) or ``SplitExpertsTP`` (``expert_tp`` = tp, weights cut
    along F and recorded in ``tp_specs``); the Switch-loss reducer and the ``SequenceShards`` gain
    the tp sum. No-op when tp = 1. Raises ValueError when F does not split over tp."""
    group = mesh.group("tp")
    if group.size == 1:
        return
    specs = dict(getattr(model, "ndtrain_tp_specs", {}))
    for name, moe in model.named_modules():
        if not isinstance(moe, TensorParallelMoE):
            continue
        ex = moe.experts
        if expert_tp > 1:
            for w, dim in (("w1", 1), ("w3", 1), ("w2", 2)):
                setattr(ex, w, _split(getattr(ex, w), dim, group))
                specs[f"{name}.experts.{w}"] = (dim, getattr(ex, w).shape[dim] * group.size)
        ex.__class__ = _tp_class(type(ex), SplitExpertsTP if expert_tp > 1 else WholeExpertsTP)
        ex.tp_group, ex.tp_reduce_dtype = group, reduce_dtype
        moe.load_reducer = _tp_reducer(group, moe.load_reducer)
        moe.seq_shards = tp_sequence_shards(moe.seq_shards, group)
    model.ndtrain_tp_specs = specs


def _tp_reducer(group: AxisGroup, inner):
    def reduce(counts: torch.Tensor) -> torch.Tensor:
        comm.all_reduce(counts, group)
        return inner(counts) if inner is not None else counts

    return reduce
