"""Zero-bubble backward split (ZB-H1, Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): the W pass.

The runtime's B pass asks autograd only for the gradients of the stage input and of the outputs of
the parameter-owning modules recorded during F (``parameter_owners``), skipping the weight-gradient
matmuls. ``accumulate_weight_grads`` is the W pass: it backpropagates each recorded output's
gradient into that module's own parameters (exactly the skipped terms), then accumulates all of them
into ``.grad`` in one backward, so data-parallel hooks and ZeRO's end-of-backward flush fire once
per W, not once per module. Needs modules that use their parameters only in their forward.
"""
from __future__ import annotations

import torch
from torch import nn


def parameter_owners(chunk: nn.Module) -> list[nn.Module]:
    """The submodules of ``chunk`` that own parameters directly (their outputs are recorded)."""
    return [mod for mod in chunk.modules() if any(True for _ in mod.parameters(recurse=False))]


def accumulate_weight_grads(wgrads: list) -> None:
    """W pass. ``wgrads``: [((module, output), d loss / d output or None), ...] from the B pass;
    adds d loss / d parameter of every module's own parameters to their ``.grad``."""
    params, grads = [], {}
    for (mod, y), g in wgrads:
        if g is None:
            continue
        ps = [q for q in mod.parameters(recurse=False) if q.requires_grad]
        for q, gq in zip(ps, torch.autograd.grad([y], ps, [g], retain_graph=True, allow_unused=True)):
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
