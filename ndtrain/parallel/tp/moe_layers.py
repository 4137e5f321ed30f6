"""Mixture-of-Experts layers under tensor parallel (Megatron-Core's MoE layout: Shoeybi et al. 2019,
Korthikanti et al. 2022; expert tensor parallel as Megatron-Core's ``expert_tensor_parallel_size``):
the modules the plan's MoE rows install (``ndtrain.parallel.tp.plan``).

Design: **the tp ranks route different tokens**. Every tp rank of an MoE layer handles a 1/tp slice
of the block's tokens along T: with sequence parallel the residual stream already is that slice
(B, T/tp, C); without it the replicated input is sliced on entry (``ScatterToSequence``: fwd split,
bwd all-gather) and the output all-gathered on exit (``GatherToReplicated``). No expert work is
done twice, and the code path is the same with and without SP.

* **Router** and the Qwen3-Next shared-expert gate: replicated (``ReplicatedLinear``), run on the
  local tokens (the router in float32, float64 in a float64 model), so every rank routes its
  tokens exactly as the single process does; their weight gradients are summed over tp.
* **Routed experts** (after expert parallel's cut), ``parallel.expert_tp``:

  - ``1`` (Megatron's default, ``WholeExpertsTP``): every tp rank keeps whole experts (with ep:
    its E/ep of them, the same block on every tp rank) and runs them on its own tokens. The
    weights see different tokens on each tp rank, so they pass through ``CopyWeightToTP`` (one
    all-reduce of the expert weights' gradients per microbatch).
  - ``tp`` (``SplitExpertsTP``): each expert's SwiGLU split like the dense FFN, w1 / w3 (E, F, C)
    by rows of F (dim 1), w2 (E, C, F) by columns (dim 2). After the ep dispatch (or directly, ep
    = 1) the tp ranks all-gather their expert-sorted token rows (variable sizes: an all-to-all-v),
    run every row through their F/tp slice and reduce-scatter the partial outputs back
    (Megatron-Core's order: ep all-to-all, then tp all-gather, so ep traffic is not multiplied).

  Under expert parallel both keep ep's ``TokenExchange`` (``ndtrain.parallel.ep.layers``) and run
  their compute between its dispatch and combine.
* **Shared experts**: a dense FFN split like the block FFN on the token rows (N_local, C):
  all-gather rows in, reduce-scatter rows out (``RegionInput`` / ``RowParallelLinear``, dim 0).
* **Statistics** cover the tp ranks' tokens together: the Switch loss's expert counts are summed
  over tp (then over its scope), the per-sequence counts and the capacity see whole sequences
  through a ``SequenceShards`` that refines cp's chunks into tp pieces (``tp_sequence_shards``),
  and after each training forward the layer's new ``LoadStats`` and its aux-loss token sum are
  summed over tp (one all-reduce of E + 6 floats): every tp rank reports and updates the
  aux-loss-free bias from the same global loads; the aux sum's gradient stays its own tokens'.

Communication per MoE layer and microbatch (A = bytes of one (B, T, C) activation): with SP the
shared experts' all-gather + reduce-scatter, nothing else on tp for ``expert_tp = 1``; without SP
one more all-gather of A. ``expert_tp = tp`` adds the row all-gather / reduce-scatter of the k
routed copies of each token.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ndtrain.mesh import AxisGroup
from ndtrain.model.moe import GroupedExperts, MoE, grouped_mm
from ndtrain.model.moe_capacity import SequenceShards
from ndtrain.optim import SHARD_AXES_ATTR, shard_axes
from ndtrain.parallel import comm
from ndtrain.parallel.ep.collectives import AllToAllV, all_to_all_v
from ndtrain.parallel.ep.layers import EXPERT_SPLIT_DIMS
from ndtrain.parallel.tp.collectives import CopyWeightToTP, GatherToReplicated, ScatterToSequence
from ndtrain.parallel.tp.layers import SEQ_DIM, TP_SHARD_ATTR


class TensorParallelMoE(MoE):
    """The ``MoE`` layer ``moe`` with its tp ranks routing different tokens (module docstring).

    Built from the layer itself: its children, buffers, statistics and settings are taken over as
    they are (the same objects), so parameter names, ``stats`` and ``expert_bias`` do not change;
    the Switch-loss reducer and the ``SequenceShards`` gain the tp sum. The plan then installs
    the router, experts and shared experts' tp modules. x (B, T, C), or (B, T/tp, C) under SP ->
    the same shape. Raises ValueError when T does not split over tp.
    """

    def __init__(self, moe: MoE, group: AxisGroup, sp: bool):
        nn.Module.__init__(self)
        self.__dict__.update(moe.__dict__)
        self.tp_group, self.tp_sp = group, sp
        self.load_reducer = _tp_reducer(group, moe.load_reducer)
        self.seq_shards = tp_sequence_shards(moe.seq_shards, group)

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return self.router(x)  # (N, E), a float32-or-wider ReplicatedLinear

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
        return f"tp={self.tp_group.size}, {entry}, load statistics summed over tp"


class _StatsMark:
    """A ``LoadStats`` snapshot taken before a forward (``record`` replaces, never mutates, counts)."""

    def __init__(self, st):
        self.counts, self.dropped, self.assigned, self.terms = st.counts, st.dropped, st.assigned, dict(st.terms)
        self.recorded = st.recorded


class _ExpertsTP(GroupedExperts):
    """Routed experts under tp, built from the layer's ``GroupedExperts`` or expert parallel's
    ``ExpertParallelExperts`` (whose ``TokenExchange`` it keeps; parameters ``w1 w3 w2`` under the
    same names). ``forward(xs, counts[, side_fn])`` as the module it replaces: xs (M, C) sorted by
    expert, counts (E,) -> (M, C). Every tp rank must call it (collectives), also with M = 0.

    Split backward (``keep_weight_grad_output``, set by the pipeline runtime): the forward leaves
    in ``weight_grad_output`` the tensor the W pass differentiates -- the local grouped-GEMM
    output, before any all-to-all whose backward B already ran (``ndtrain.parallel.pp.split_backward``).
    """

    keep_weight_grad_output = False
    weight_grad_output: torch.Tensor | None = None
    split = False

    def __init__(self, experts: GroupedExperts, group: AxisGroup, reduce_dtype: torch.dtype | None = None,
                 axis: str = "tp"):
        nn.Module.__init__(self)
        self.impl, self.tp_group, self.tp_reduce_dtype = experts.impl, group, reduce_dtype
        self.exchange = getattr(experts, "exchange", None)  # expert parallel's dispatch / combine
        self.accepts_side_fn = self.exchange is not None  # MoE's shared-expert overlap entry
        for w, dim in EXPERT_SPLIT_DIMS.items():
            p = getattr(experts, w)
            setattr(self, w, _split(p, dim, group, axis) if self.split else p)

    def forward(self, xs: torch.Tensor, counts: torch.Tensor, side_fn=None):
        if self.exchange is None:
            return self.local(xs, counts)
        xr, local_counts, route = self.exchange.dispatch(xs, counts, self.training, side_fn)
        return self.exchange.combine(self.local(xr, local_counts), route)

    def local(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        el, f, c, tp = self.w1.shape[0], self.w1.shape[1], self.w1.shape[2], self.tp_group.size
        where = (f"{self.exchange.describe(el)} (ep dispatch / combine: all-to-all)" if self.exchange is not None
                 else f"experts {el}")
        how = (f"hidden={f * tp}/tp{tp}, dim={c}, rows: all-gather / reduce-scatter over tp" if self.split
               else f"hidden={f}, dim={c}, whole on tp{tp}, weight grad: all-reduce over tp")
        return f"{where}, {how}"


class WholeExpertsTP(_ExpertsTP):
    """``parallel.expert_tp = 1``: whole experts on every tp rank, run on this rank's tokens; the
    weights pass through ``CopyWeightToTP`` (gradient summed over tp). xs (M, C), counts (E_l,)."""

    def local(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w3, w2 = (CopyWeightToTP.apply(getattr(self, n), self.tp_group, self.tp_reduce_dtype)
                      for n in ("w1", "w3", "w2"))
        h = F.silu(grouped_mm(xs, w1, counts, self.impl)) * grouped_mm(xs, w3, counts, self.impl)  # (M, F)
        y = grouped_mm(h, w2, counts, self.impl)  # (M, C)
        if self.keep_weight_grad_output:
            self.weight_grad_output = y
        return y


class SplitExpertsTP(_ExpertsTP):
    """``parallel.expert_tp = tp``: each expert's hidden F split over tp. xs (M, C) this rank's
    rows sorted by (local) expert, counts (E_l,) -> (M, C) the whole expert outputs of those rows:
    all-gather the tp ranks' rows (variable sizes), run them through the F/tp slice, reduce-scatter
    the partial sums back (``weight_grad_output``: those partial sums). Raises ValueError when F
    does not split over tp."""

    split = True

    def local(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        g, el, m = self.tp_group, counts.numel(), xs.shape[0]
        tp = g.size
        every = torch.empty(tp, el, dtype=counts.dtype, device=counts.device)  # (tp, E_l) rows per rank, expert
        all_to_all_v(every, counts.view(1, el).expand(tp, el).contiguous(), [1] * tp, [1] * tp, g)
        rows = every.sum(1).tolist()  # rows each tp rank holds
        xa = AllToAllV.apply(xs.repeat(tp, 1), rows, [m] * tp, g)  # (R, C), (source, expert) order
        seg = torch.arange(tp * el, device=xs.device).repeat_interleave(every.reshape(-1))  # (R,) s*el + e
        perm = torch.argsort((seg % el) * tp + seg // el, stable=True)  # -> (expert, source) order
        y = GroupedExperts.forward(self, xa[perm], every.sum(0))  # (R, C) partial sums over F/tp
        if self.keep_weight_grad_output:
            self.weight_grad_output = y
        y = y.new_zeros(y.shape).index_copy(0, perm, y)  # back to (source, expert) order
        return AllToAllV.apply(y, [m] * tp, rows, g).view(tp, m, -1).sum(0)  # (M, C)


def _split(p: nn.Parameter, dim: int, group: AxisGroup, axis: str = "tp") -> nn.Parameter:
    """This rank's slice of an expert weight along ``dim`` (F), tagged as split over ``axis`` (after
    any ep tag: shard axes ``("ep", "tp")``). Only a split over the attention tp carries the tp
    checkpoint spec; the folded mesh's ``expert_tp`` split is presented by expert parallel's state."""
    size = p.shape[dim]
    if size % group.size:
        raise ValueError(f"expert hidden size ({size}) is not divisible by {axis} ({group.size}) "
                         "(parallel.expert_tp)")
    local = nn.Parameter(p.detach().chunk(group.size, dim)[group.rank].clone(), requires_grad=p.requires_grad)
    setattr(local, SHARD_AXES_ATTR, shard_axes(p) + (axis,))
    if axis == "tp":
        setattr(local, TP_SHARD_ATTR, (dim, size))
    return local


def apply_expert_tp(model: nn.Module, mesh) -> None:
    """The folded expert mesh's ``expert_tp`` split (``ndtrain.mesh``): every MoE layer's routed
    experts (after expert parallel's cut) become ``SplitExpertsTP`` over the ``expert_tp`` group,
    weights tagged ``"expert_tp"``. The ranks of that group hold different tokens (other dp / cp /
    tp shards), which the split's row all-gather collects and its reduce-scatter returns, so it
    needs no attention tp. Call after ``apply_ep``, before ``apply_tp`` (whose plan then leaves the
    ``folded`` experts alone). Raises ValueError when F does not split over expert_tp."""
    group = mesh.group("expert_tp")
    for moe in [m for m in model.modules() if isinstance(m, MoE)]:
        experts = SplitExpertsTP(moe.experts, group, axis="expert_tp")
        experts.folded = True
        moe.experts = experts


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


def _tp_reducer(group: AxisGroup, inner):
    def reduce(counts: torch.Tensor) -> torch.Tensor:
        comm.all_reduce(counts, group)
        return inner(counts) if inner is not None else counts

    return reduce
