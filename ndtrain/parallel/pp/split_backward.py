"""Zero-bubble backward split (ZB-H1, Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): the W pass.

B asks autograd only for the stage input's gradient and those of the parameter owners' recorded
outputs; W (``accumulate_weight_grads``) backpropagates each output's gradient into its module's
own parameters and accumulates all of them in one backward, so dp hooks and ZeRO's flush fire once.
Needs modules that use their parameters only in their forward.

A module whose output lies behind a collective names an earlier tensor in ``weight_grad_output``
(an ep layer's local GEMM output: W must not rerun the combine's backward). Most weight gradients
need no parameter values (g^T x), so ZeRO-3 may free a unit between B and W; owners that chain
their parameters (``reads_parameters``: MoE's stacked experts, Mamba-2 / Gated DeltaNet mixers)
run W inside ``gather(params)`` (``FullyShardedDataParallel.gathered``)."""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn


def parameter_owners(chunk: nn.Module) -> list[nn.Module]:
    """The submodules of ``chunk`` that own parameters directly (their outputs are recorded)."""
    return [mod for mod in chunk.modules() if any(True for _ in mod.parameters(recurse=False))]


def shared_parameters(owners: list[list[nn.Module]]) -> set[int]:
    """Ids of parameters owned by more than one module (tied embedding / head): per-module W would count
    them twice."""
    holders: dict[int, set[int]] = {}
    for chunk in owners:
        for mod in chunk:
            for q in mod.parameters(recurse=False):
                holders.setdefault(id(q), set()).add(id(mod))
    return {k for k, mods in holders.items() if len(mods) > 1}


def direct_parameters(owners: list[nn.Module], captured: list, shared: set[int]) -> list[nn.Parameter]:
    """Parameters whose gradient B takes directly: shared ones, and those of owners whose forward did not
    run (``captured``: the recorded (module, output) pairs) unless one that ran owns them too."""
    ran = {id(mod) for mod, _ in captured}
    seen = {id(q) for mod, _ in captured for q in mod.parameters(recurse=False)}
    out = {}
    for mod in owners:
        for q in mod.parameters(recurse=False):
            if q.requires_grad and (id(q) in shared or (id(mod) not in ran and id(q) not in seen)):
                out[id(q)] = q
    return list(out.values())


def reads_parameters(mod: nn.Module) -> bool:
    """Whether ``mod``'s weight gradient may read parameter values: it owns two or more parameters or has
    parameter-owning children, and is not a torch.nn layer. Conservative (a needless re-gather costs
    traffic, not correctness)."""
    if type(mod).__module__.startswith("torch.nn."):
        return False
    own = sum(1 for _ in mod.parameters(recurse=False))
    return own > 1 or any(True for child in mod.children() for _ in child.parameters())


def accumulate_weight_grads(wgrads: list, direct: list | None = None, skip: set[int] = frozenset(),
                            gather: Callable | None = None) -> None:
    """W pass: for ``wgrads`` [((module, output), d loss / d output or None)], add the gradients of each
    module's own parameters (but ``skip``) to ``.grad``, with ``direct`` [(parameter, grad)] from B in
    the same backward. ``gather``: context factory making values present (ZeRO-3), entered for owners
    that ``reads_parameters``. Every dp rank runs the same W in the same order (matching all-gathers)."""
    params, grads = [], {}
    for q, gq in direct or []:
        if gq is not None:
            if id(q) in grads:
                grads[id(q)] = grads[id(q)] + gq
            else:
                params.append(q)
                grads[id(q)] = gq
    for (mod, y), g in wgrads:
        if g is None:
            continue
        ps = [q for q in mod.parameters(recurse=False) if q.requires_grad and id(q) not in skip]
        if not ps:
            continue
        regather = gather is not None and reads_parameters(mod)
        with gather(list(mod.parameters())) if regather else contextlib.nullcontext():
            got = torch.autograd.grad([y], ps, [g], retain_graph=True, allow_unused=True)
        for q, gq in zip(ps, got):
            if gq is None:
                continue
            if id(q) in grads:
                grads[id(q)] = grads[id(q)] + gq
            else:
                params.append(q)
                grads[id(q)] = gq
    if params:  # one backward per W: data-parallel hooks and end-of-backward flushes fire once
        torch.autograd.backward([_AccumulateInto.apply([grads[id(q)] for q in params], *params)],
                                inputs=params)


class _AccumulateInto(torch.autograd.Function):
    """fwd: a 0-d zero depending on ``params`` (data not read; ZeRO-3 may have freed it); bwd: the given
    gradients, which autograd accumulates into ``.grad``."""

    @staticmethod
    def forward(ctx, grads, *params):
        ctx.grads = grads
        return params[0].new_zeros(())

    @staticmethod
    def backward(ctx, _):
        return (None, *ctx.grads)
