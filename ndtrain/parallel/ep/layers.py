"""The expert-parallel experts module (GShard, Lepikhin 2020): ``apply_ep`` installs it in place of a
MoE layer's ``GroupedExperts``, so ``print(model)`` shows which experts a rank holds.

It is a ``GroupedExperts`` holding only this rank's E/ep experts (parameters ``w1`` / ``w3`` /
``w2`` under the same names, so state-dict keys do not change) whose ``forward`` takes the tokens
of *all* E experts, as ``MoE.run_experts`` hands them over, and runs the dispatch / local experts /
combine of ``ndtrain.parallel.ep.expert_parallel`` (module docstring there).
"""
from __future__ import annotations

import torch
from torch import nn

from ndtrain.mesh import AxisGroup
from ndtrain.model.moe import GroupedExperts
from ndtrain.model.moe_autograd import scatter_rows
from ndtrain.optim import SHARD_AXES_ATTR
from ndtrain.parallel.ep.collectives import AllToAllV, all_to_all_v
from ndtrain.parallel.ep.overlap import dispatch_overlapped

EXPERT_WEIGHTS = ("w1", "w3", "w2")
EXPERT_SPLIT_DIMS = {"w1": 1, "w3": 1, "w2": 2}  # each weight's hidden (F) dim: (E, F, C), (E, C, F)


class ExpertParallelExperts(GroupedExperts):
    """Experts ``[r E/ep, (r+1) E/ep)`` of a ``GroupedExperts`` on ep rank r, cut from ``full``
    (whose own weights are left untouched). Parameters are tagged ``ndtrain_shard_axes = ("ep",)``.

    ``forward(xs, counts)``: xs (M, C) this rank's routed tokens sorted by global expert id,
    counts (E,) int64 per global expert -> (M, C) the experts' outputs in the same order. Every
    rank must call it (the all-to-alls are collectives), also with M = 0. ``tally``: the MoE
    layer's ``LoadStats``; the token all-to-alls of training forwards (and their backward) add
    their bytes to its ``a2a_bytes`` (the (ep, E/ep) count exchange and evaluation forwards are
    counted on the ``ep`` axis only).
    Raises ValueError if E is not divisible by ep.
    """

    accepts_side_fn = True  # MoE.forward_tokens' duck-typed overlap entry (parallel.moe_shared_overlap)
    # The split backward's W pass (pp zero_bubble / dualpipev) differentiates a module's output
    # w.r.t. its own weights. Ours comes after the combine all-to-all, whose backward B already
    # ran: W from there would repeat it. So when the pipeline runtime asks for it
    # (``keep_weight_grad_output``, set only under split schedules, so no other schedule keeps a
    # reference to an activation) the forward leaves the local grouped-GEMM output in
    # ``weight_grad_output``, which the runtime's forward hook records instead of the output
    # (and clears): W then reaches the weights through the local GEMMs only.
    keep_weight_grad_output = False
    weight_grad_output: torch.Tensor | None = None

    def __init__(self, full: GroupedExperts, group: AxisGroup, tally=None):
        n_experts = full.w1.shape[0]
        if n_experts % group.size:
            raise ValueError(f"moe_experts ({n_experts}) is not divisible by ep ({group.size})")
        el = n_experts // group.size
        with torch.device("meta"):  # placeholders only: replaced by the slices below
            super().__init__(el, full.w1.shape[2], full.w1.shape[1])
        self.impl, self.group, self.n_experts = full.impl, group, n_experts
        self.exchange = TokenExchange(group, tally)
        lo = group.rank * el
        for w in EXPERT_WEIGHTS:
            local = nn.Parameter(getattr(full, w).detach()[lo:lo + el].clone())  # (E/ep, ., .)
            setattr(local, SHARD_AXES_ATTR, ("ep",))
            setattr(self, w, local)

    def forward(self, xs: torch.Tensor, counts: torch.Tensor, side_fn=None):
        """xs (M, C), counts (E,) -> (M, C); with ``side_fn`` (``parallel.moe_shared_overlap``:
        ``MoE`` passes its shared-expert closure) -> ((M, C), ``side_fn()``), ``side_fn`` run while
        the dispatch all-to-all is in flight (``ndtrain.parallel.ep.overlap``; backward synchronous).
        Called through the module (``self.experts(...)``) so ZeRO-3's unit hooks still fire.
        With ``keep_weight_grad_output`` set, also sets ``weight_grad_output`` to the local experts'
        output (R, C) (R: rows received), in (expert, source) order, before the combine."""
        xr, local_counts, route = self.exchange.dispatch(xs, counts, self.training, side_fn)
        y = super().forward(xr, local_counts)  # (R, C)
        if self.keep_weight_grad_output:
            self.weight_grad_output = y
        return self.exchange.combine(y, route)

    def extra_repr(self) -> str:
        return (f"{self.exchange.describe(self.w1.shape[0])}, hidden={self.w1.shape[1]}, dim={self.w1.shape[2]}, "
                "dispatch / combine: all-to-all")


class TokenExchange:
    """The dispatch / combine of expert parallel, apart from the expert compute between them (so
    tensor parallel's experts, ``ndtrain.parallel.tp.moe_layers``, run their own compute inside).

    ``dispatch(xs, counts, training, side_fn)``: xs (M, C) sorted by global expert id, counts (E,)
    -> (rows received (R, C) in (local expert, source) order, their counts per local expert
    (E/ep,), the route for ``combine``). ``combine(y, route)``: the local outputs (R, C) -> (M, C)
    in xs's order, or ((M, C), ``side_fn()``) when a ``side_fn`` was given. Collective over the
    ep group (also with M = 0). ``tally``: the MoE layer's ``LoadStats``, which counts the token
    all-to-all bytes of training forwards (and their backward); not named ``stats``, by which
    ``moe_layers()`` finds MoE layers.
    """

    def __init__(self, group: AxisGroup, tally=None):
        self.group, self.tally = group, tally

    def dispatch(self, xs: torch.Tensor, counts: torch.Tensor, training: bool, side_fn=None):
        ep = self.group.size
        el = counts.numel() // ep
        send = counts.view(ep, el).contiguous()  # (ep, E/ep): row r -> rank r's experts
        recv = torch.empty_like(send)  # (ep, E/ep): row s = rows source s sends to my experts
        all_to_all_v(recv, send, [1] * ep, [1] * ep, self.group)
        in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        tally = self.tally if training else None  # the metric counts training steps, not evaluation
        side = None
        if side_fn is None:
            xr = AllToAllV.apply(xs, out_splits, in_splits, self.group, tally)  # (R, C), (source, expert) order
        else:
            xr, side = dispatch_overlapped(xs, out_splits, in_splits, self.group, tally, side_fn)
        seg = torch.arange(ep * el, device=xs.device).repeat_interleave(recv.reshape(-1))  # (R,) s*el + e
        perm = torch.argsort((seg % el) * ep + seg // el, stable=True)  # -> (expert, source) order
        return xr[perm], recv.sum(0), (perm, in_splits, out_splits, tally, side_fn is not None, side)

    def combine(self, y: torch.Tensor, route):
        perm, in_splits, out_splits, tally, with_side, side = route
        y = scatter_rows(y, perm, y.shape[0])  # back to (source, expert) order; backward keeps perm only
        out = AllToAllV.apply(y, in_splits, out_splits, self.group, tally)  # (M, C)
        return (out, side) if with_side else out

    def describe(self, local_experts: int) -> str:
        r, n = self.group.rank, local_experts * self.group.size
        return f"experts [{r * local_experts}, {(r + 1) * local_experts}) of {n} on ep{self.group.size} rank {r}"
