"""DiLoCo / local SGD over the ``dp_replicate`` axis (Douillard et al. 2023, "DiLoCo: Distributed
Low-Communication Training of Language Models"; local SGD: Stich 2019, Lin et al. 2020).

Each replica (one index of ``dp_replicate``; inside it the usual data / tensor / pipeline / context
parallelism) trains on its own share of every global batch with its own inner optimizer (the
run's AdamW), its gradients synchronised only *within* the replica (``parallelize`` gives DDP the
``dp_shard`` / ``dp_shard_cp`` group instead of ``dp`` / ``dp_cp``). Every ``H`` inner steps
(``training.local_sgd_steps``) the replicas meet (Algorithm 1 of the paper):

    delta   = anchor - theta_r                 (outer gradient of replica r)
    delta  <- mean over replicas of delta      one all-reduce over dp_replicate of the parameters
    anchor <- OuterOpt(anchor, delta)          SGD, lr ``outer_lr``, Nesterov momentum ``outer_momentum``
    theta_r <- anchor                          every replica restarts from the same point

so the ``dp_replicate`` link carries 2 (R-1)/R * Psi bytes per H steps instead of per step. With
H = 1, outer lr 1 and momentum 0 the anchor moves by the mean of the replicas' inner updates;
with an inner step linear in the gradient (SGD) that is exactly synchronous data parallel with the
replica-mean gradient -- the twin ``tests/parallel/test_diloco.py`` pins. (With AdamW the mean of
per-replica updates is not the update of the mean gradient, so H = 1 is not DDP there.)

The loss of each replica is normalised by the replica's own valid tokens (the plan's loss group is
``dp_shard_cp``), so its gradient is its batch's mean gradient whatever the number of replicas.
Parameters are this rank's local tensors (a TP / PP shard): the averaging pairs the same shard
across replicas.

A skipped step (a bad step, an fp16 overflow) changes nothing, the inner-step count included: the
outer step follows H *applied* inner steps. Checkpoints (``pack`` / ``unpack``, through the
checkpoint adapter, so every tensor is whole under its global name and resharded on load) hold:
``model`` the anchor (the replicas' common model; equal to the weights at an outer boundary),
``inner.replica<k>`` and ``optim.replica<k>`` each replica's current weights and AdamW state,
``outer`` the outer momentum and the outer / inner step counts. A checkpoint taken anywhere inside
an interval therefore resumes every replica exactly; it costs one more copy of the weights per
replica. Resuming needs the same ``dp_replicate``.
"""
from __future__ import annotations

import torch
from torch import nn

from ndtrain.mesh import Mesh
from ndtrain.parallel import comm


def _local(p: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard, else the parameter's data."""
    return p._local_tensor if hasattr(p, "_local_tensor") else p.data


class DiLoCo:
    """The outer loop of DiLoCo for one rank (see the module docstring); an ``OuterSync``.

    Args:
        model: this rank's (parallelized) model; its parameters at construction are the anchor.
        mesh: the layout; the outer all-reduce runs over ``mesh.group("dp_replicate")``.
        local_sgd_steps: H, applied inner steps per outer step (>= 1).
        outer_lr, outer_momentum: the outer SGD; Nesterov when momentum > 0.
    Communication: one all-reduce of every local parameter (in its dtype) per H steps, counted on
    the ``dp_replicate`` axis, and one 8-byte loss all-reduce per step.
    """

    def __init__(self, model: nn.Module, mesh: Mesh, local_sgd_steps: int, outer_lr: float,
                 outer_momentum: float):
        self.group = mesh.group("dp_replicate")
        self.h = local_sgd_steps
        index: dict[int, int] = {}
        self.params, self.slot = [], {}  # slot: every name of a parameter (tied ones too) -> index
        for name, p in model.named_parameters(remove_duplicate=False):
            if p.requires_grad:
                if id(p) not in index:
                    index[id(p)] = len(self.params)
                    self.params.append(p)
                self.slot[name] = index[id(p)]
        self.anchor = [_local(p).detach().clone() for p in self.params]
        self.outer = torch.optim.SGD(self.anchor, lr=outer_lr, momentum=outer_momentum,
                                     nesterov=outer_momentum > 0)
        self.outer_steps = 0
        self.inner_steps = 0  # applied inner steps since the last outer step

    def step_loss(self, loss: float) -> float:
        """The replicas' mean loss (each normalised by its own tokens); the same on every rank."""
        dev = self.anchor[0].device if self.anchor else "cpu"
        return comm.all_reduce_scalar(loss, self.group, device=dev) / self.group.size

    def after_step(self, applied: bool) -> dict:
        """After an optimizer step (every rank agrees on ``applied``): the H-th applied inner step
        runs the outer step (collective). Returns ``{"outer_step": whether it ran}``."""
        if applied:
            self.inner_steps += 1
        if not applied or self.inner_steps < self.h:
            return {"outer_step": False}
        self.outer_step()
        return {"outer_step": True}

    @torch.no_grad()
    def outer_step(self) -> None:
        """Average the replicas' deltas, step the anchor, reset every replica to it."""
        deltas = [a - _local(p) for a, p in zip(self.anchor, self.params)]
        flat = torch.cat([d.reshape(-1) for d in deltas])  # (sum numel,) one all-reduce
        comm.all_reduce(flat, self.group)
        flat /= self.group.size
        offset = 0
        for a, d in zip(self.anchor, deltas):
            n = d.numel()
            a.grad = flat[offset:offset + n].view_as(a).clone()
            offset += n
        self.outer.step()
        for a, p in zip(self.anchor, self.params):
            a.grad = None
            _local(p).copy_(a)
        self.outer_steps += 1
        self.inner_steps = 0

    @torch.no_grad()
    def weights_loaded(self) -> None:
        """The current parameters become the anchor (after loading weights); momentum and the
        interval restart."""
        for a, p in zip(self.anchor, self.params):
            a.copy_(_local(p))
        self.outer.state.clear()
        self.inner_steps = 0

    def _momentum(self, i: int) -> torch.Tensor:
        """Outer momentum of parameter ``i``; zeros before the first outer step (``unpack`` then
        restores none, as SGD's first step treats an absent buffer differently from zeros)."""
        buf = self.outer.state.get(self.anchor[i], {}).get("momentum_buffer")
        return buf if buf is not None else torch.zeros_like(self.anchor[i])

    def pack(self, state: dict, whole) -> dict:
        """``OuterSync.pack``: the anchor as ``model`` (buffers kept), this replica's weights and
        AdamW state under ``inner`` / ``optim`` ``replica<k>``, momentum and counts under ``outer``."""
        key = f"replica{self.group.rank}"
        names = [n for n in self.slot if n in state["model"]]
        inner = {n: state["model"][n] for n in names}
        model = {**state["model"], **whole({n: self.anchor[self.slot[n]] for n in names})}
        outer = {"momentum": whole({n: self._momentum(self.slot[n]) for n in names}),
                 "outer_steps": torch.tensor(self.outer_steps, dtype=torch.int64),
                 "inner_steps": torch.tensor(self.inner_steps, dtype=torch.int64)}
        return {"model": model, "optim": {key: state["optim"]}, "inner": {key: inner}, "outer": outer}

    @torch.no_grad()
    def unpack(self, state: dict, local) -> dict:
        """``OuterSync.unpack``: restore the anchor, momentum and counts from a tree shaped like
        ``pack``'s; returns this replica's ``{"model": weights, "optim": AdamW state}``."""
        key = f"replica{self.group.rank}"
        names = [n for n in self.slot if n in state["model"]]
        anchor = local({n: state["model"][n] for n in names})
        mom = local({n: state["outer"]["momentum"][n] for n in names})
        self.outer_steps = int(state["outer"]["outer_steps"])
        self.inner_steps = int(state["outer"]["inner_steps"])
        self.outer.state.clear()
        for n in names:
            a = self.anchor[self.slot[n]]
            a.copy_(anchor[n])
            if self.outer_steps > 0 and self.outer.defaults["momentum"] > 0:
                self.outer.state[a] = {"momentum_buffer": mom[n].clone()}
        return {"model": {**state["model"], **state["inner"][key]}, "optim": state["optim"][key]}
