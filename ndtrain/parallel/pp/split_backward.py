"""Zero-bubble backward split (ZB-H1, Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): the W pass.

The runtime's B pass asks autograd only for the gradients of the stage input and of the outputs of
the parameter-owning modules recorded during F (``parameter_owners``), skipping the weight-gradient
matmuls. ``accumulate_weight_grads`` is the W pass: it backpropagates each recorded output's
gradient into that module's own parameters (exactly the skipped terms), then accumulates all of them
into ``.grad`` in one backward, so data-parallel hooks and ZeRO's end-of-backward flush fire once
per W, not once per module. Needs modules that use their parameters only in their forward.

A module whose output lies behind a collective names an earlier tensor instead: with
``keep_weight_grad_output`` set (by the runtime, under split schedules only) its forward leaves it
in ``weight_grad_output``, and the runtime's hook records that tensor (and clears the attribute).
An expert-parallel layer (``ep.layers.ExpertParallelExperts``) names its local grouped-GEMM output:
W from the layer output would run the combine all-to-all's backward a second time (B has run it).

Most owners' weight gradients need no parameter *values* (a linear layer's is g^T x, from saved
activations), so ZeRO-3 may free a unit between B and W. An owner that chains its own parameters,
or holds parameter-owning children its own parameters feed (``reads_parameters``: MoE's stacked
experts, where d/d w1 passes through w2; a Mamba-2 / Gated DeltaNet mixer, whose A_log reaches the
output through its projections), does read them: W runs its gradient inside ``gather(params)``,
ZeRO-3's ``FullyShardedDataParallel.gathered`` (re-gathers the freed units, frees them after).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn


def parameter_owners(chunk: nn.Module) -> list[nn.Module]:
    """The submodules of ``chunk`` that own parameters directly (their outputs are recorded)."""
    return [mod for mod in chunk.modules() if any(True for _ in mod.parameters(recurse=False))]


def shared_parameters(owners: list[list[nn.Module]]) -> set[int]:
    """Ids of the parameters owned directly by more than one module (over all chunks' ``owners``):
    a tied embedding / head. Per-module W would count such a weight twice when one module's output
    also depends on the other's use of it (MTP's embedding lookup feeding the tied head)."""
    holders: dict[int, set[int]] = {}
    for chunk in owners:
        for mod in chunk:
            for q in mod.parameters(recurse=False):
                holders.setdefault(id(q), set()).add(id(mod))
    return {k for k, mods in holders.items() if len(mods) > 1}


def direct_parameters(owners: list[nn.Module], captured: list, shared: set[int]) -> list[nn.Parameter]:
    """The chunk's parameters whose gradient the B pass takes directly (whole, by every path):
    shared ones, and those of owners whose forward did not run (``captured``: the (module,
    output) pairs recorded in the chunk's forward) unless a module that ran owns them too."""
    ran = {id(mod) for mod, _ in captured}
    seen = {id(q) for mod, _ in captured for q in mod.parameters(recurse=False)}
    out = {}
    for mod in owners:
        for q in mod.parameters(recurse=False):
            if q.requires_grad and (id(q) in shared or (id(mod) not in ran and id(q) not in seen)):
                out[id(q)] = q
    return list(out.values())


def reads_parameters(mod: nn.Module) -> bool:
    """Whether the gradient of ``mod``'s own parameters at its output may read parameter values:
    ``mod`` owns two or more parameters directly, or has parameter-owning children, and is not one
    of torch.nn's own layers (Linear, Conv, Embedding, LayerNorm: weight and bias gradients from
    activations alone). Conservative: a custom module with an unchained weight and bias is
    re-gathered needlessly (traffic, not a wrong result)."""
    if type(mod).__module__.startswith("torch.nn."):
        return False
    own = sum(1 for _ in mod.parameters(recurse=False))
    return own > 1 or any(True for child in mod.children() for _ in child.parameters())


def accumulate_weight_grads(wgrads: list, direct: list | None = None, skip: set[int] = frozenset(),
                            gather: Callable | None = None) -> None:
    """W pass. ``wgrads``: [((module, output), d loss / d output or None), ...] from the B pass;
    adds d loss / d parameter of every module's own parameters (but those in ``skip``, by id) to
    their ``.grad``. ``direct``: [(parameter, d loss / d parameter or None), ...] already computed
    by the B pass (``direct_parameters``), accumulated in the same backward. ``gather``: a context
    manager factory taking a list of parameters whose values must be present inside it (ZeRO-3's
    ``gathered``), entered for owners that ``reads_parameters``; None: values always present.
    Every rank of a data-parallel group runs the same W in the same order, so its all-gathers match.
    """
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
    """fwd: a 0-d zero that depends on ``params`` (their data is not read; ZeRO-3 may have freed
    it), bwd: the given gradients for ``params``, which autograd accumulates into ``.grad``."""

    @staticmethod
    def forward(ctx, grads, *params):
        ctx.grads = grads
        return params[0].new_zeros(())

    @staticmethod
    def backward(ctx, _):
        return (None, *ctx.grads)
