"""Routed token counts in the fake world: the values a MoE step's shapes depend on.

A fake tensor has no values, but an expert rank's shapes do: the tokens per expert
(``bincount``), the all-to-all split sizes (host reads of the exchanged counts), the rows each
expert's GEMM takes. Under forced routing (``training.moe_routing: balanced``, which the
``--moe-routing`` choices ``uniform`` and ``balanced`` select) the expert of every token follows
from its sequence position alone (``model.moe_capacity.balanced_assignment``), so those values are
computable: ``Shadows`` keeps a real twin ("shadow") of every tensor derived from an ``arange``
(the positions) by operators whose tensor inputs all have one (or are real / fake constants), and
answers the data-dependent operators and host reads from the twins. Float data (the router's
logits, activations) never gets a twin, so nothing large is computed for real.

Collectives: the fake group moves nothing, so an all-to-all's received twin is modelled: every
ep peer routes as this rank does (true for forced routing when the peers hold the same sequence
positions, as under ep x dp); any other collective on a shadowed tensor drops its twin (its host
reads then get the plain stand-ins, which only metrics read)."""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException, DynamicOutputShapeException, FakeTensor, unset_fake_temporarily)
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

ROUTINGS = ("uniform", "balanced", "skewed:S")
_SEEDS = {torch.ops.aten.arange.default, torch.ops.aten.arange.start, torch.ops.aten.arange.start_step}
_UNSET = {torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default,
          torch.ops.aten.new_empty_strided.default}  # values unset: no twin (a collective may fill them)
_LIMIT = 2**26  # elements of a twin: positions and routing indices are far below; never activations


def parse_routing(text: str, ep: int = 1) -> tuple[str, float]:
    """``uniform`` | ``balanced`` | ``skewed:S`` -> (kind, S); S = 1 unless skewed, where
    1 <= S <= ``ep`` (the busiest ep rank's load over the mean). Raises ValueError (one line)."""
    if text in ("uniform", "balanced"):
        return text, 1.0
    if text.startswith("skewed:"):
        try:
            s = float(text[len("skewed:"):])
        except ValueError:
            s = float("nan")
        if ep < 2:
            raise ValueError(f"--moe-routing {text} needs expert parallelism (parallel.ep > 1)")
        if not 1.0 <= s <= ep:
            raise ValueError(f"--moe-routing {text}: S must be a number in [1, ep = {ep}]")
        return "skewed", s
    raise ValueError(f"--moe-routing ({text}) must be uniform | balanced | skewed:S")


def skew_weights(s: float, ep: int) -> tuple[int, int]:
    """Integer weights (a, b) of ep rank 0's experts and every other expert in the skewed cycle:
    rank 0's load over the mean is a ep / (a + b (ep - 1)) = S, so a / b = S (ep - 1) / (ep - S)
    (b = 0 at S = ep), to 1/64."""
    from fractions import Fraction

    if s >= ep:
        return 1, 0
    r = Fraction(s * (ep - 1) / (ep - s)).limit_denominator(64)
    return r.numerator, r.denominator


def skewed_assignment(s: float, ep: int):
    """A ``balanced_assignment`` stand-in (same signature) for ``skewed:S``: slot j of the token at
    sequence position p goes to ``L[(p k + j) mod len(L)]``, L a cycle in which each expert of ep
    rank 0 appears a times and every other expert b times (``skew_weights``), interleaved. By
    position only, so every ep peer routes alike and ep rank 0 is the busiest, S x the mean over
    whole cycles. The k experts of a token need not be distinct (only the counts matter here)."""

    def assign(shape, k, n_experts, shards=None, device="cpu"):
        a, b = skew_weights(s, ep)
        q = n_experts // ep
        weight = [a if e < q else b for e in range(n_experts)]
        with unset_fake_temporarily():  # a real tensor: its values are known (its own twin)
            cycle = torch.tensor([e for r in range(max(a, b)) for e in range(n_experts) if weight[e] > r])
        bt, t = shape
        if shards is None or shards.size == 1:
            pos = torch.arange(t, device=device)
        else:
            per = t // len(shards.local)
            pos = torch.cat([c * per + torch.arange(per, device=device) for c in shards.local])
        idx = cycle[(pos.unsqueeze(1) * k + torch.arange(k, device=device)) % cycle.numel()]  # (T_local, k)
        return idx.expand(bt, t, k).reshape(bt * t, k)
    return assign


class Shadows:
    """Real twins of fake tensors (module docstring); used by ``fake.HostReads``."""

    def __init__(self):
        self.table = WeakIdKeyDictionary()

    def twin(self, t):
        """The real value of ``t`` (a real tensor itself, a fake constant, a twin) or None."""
        if not isinstance(t, torch.Tensor):
            return t
        if not isinstance(t, FakeTensor):
            return t
        if t.constant is not None:
            return t.constant
        return self.table.get(t)

    def read(self, t):
        """A host read of ``t`` from its twin, or None when it has none."""
        v = self.twin(t) if isinstance(t, FakeTensor) else None
        if v is None:
            return None
        with unset_fake_temporarily():
            return v.item()

    def dispatch(self, func, args, kwargs, run):
        """``run()`` (the fake operator) with twins kept for its outputs; answers data-dependent
        output shapes from the twins."""
        flat, _ = tree_flatten((args, kwargs))
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        if func.namespace == "c10d":
            out = run()
            self._collective(func, args, tensors)
            return out
        if func in _UNSET or (func not in _SEEDS and not tensors):
            return run()
        twins = [self.twin(a) for a in tensors]
        if func not in _SEEDS and (any(v is None for v in twins) or sum(v.numel() for v in twins) > _LIMIT):
            self._drop_written(func, args)
            return run()
        try:
            with unset_fake_temporarily():
                real = func(*tree_map(self._real_arg, args), **tree_map(self._real_arg, kwargs or {}))
        except (IndexError, RuntimeError):  # a twin the operator cannot take: no twins from here
            self._drop_written(func, args)
            return run()
        try:
            out = run()
        except (DynamicOutputShapeException, DataDependentOutputException):
            out = tree_map(_fake_like, real)
        outs, _ = tree_flatten(out)
        reals, _ = tree_flatten(real)
        for o, r in zip(outs, reals):
            if isinstance(o, FakeTensor) and isinstance(r, torch.Tensor) and r.numel() <= _LIMIT:
                self.table[o] = r
        return out

    def _real_arg(self, a):
        return self.twin(a) if isinstance(a, torch.Tensor) else a

    def _drop_written(self, func, args) -> None:
        """An in-place op with an input lacking a twin: the written tensors' twins are stale."""
        for arg, val in zip(func._schema.arguments, args):
            if arg.alias_info is not None and arg.alias_info.is_write and isinstance(val, torch.Tensor):
                self.table.pop(val, None)

    def _collective(self, func, args, tensors) -> None:
        """The received twin of an all-to-all of equal chunks: every peer sends what this rank
        sends to itself (peers route alike); other collectives drop their outputs' twins."""
        if func is torch.ops.c10d.alltoall_base_.default:
            out, inp, pg = args[0], args[1], args[2]
            src = self.twin(inp)
            if src is not None and isinstance(out, FakeTensor):
                pg = torch._C._distributed_c10d.ProcessGroup.unbox(pg)  # the boxed group the op gets
                n, me = pg.size(), pg.rank()
                with unset_fake_temporarily():
                    mine = src.reshape(n, -1)[me]
                    self.table[out] = mine.repeat(n).reshape(out.shape).clone()
                return
        for t in tensors:
            if isinstance(t, FakeTensor):
                self.table.pop(t, None)


def _fake_like(r):
    """A fake tensor of real ``r``'s shape, stride and dtype (called within the fake mode)."""
    if not isinstance(r, torch.Tensor):
        return r
    return torch.empty_strided(r.shape, r.stride(), dtype=r.dtype)
