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

The loss of each replica is normalised by the replica's own valid tokens (the trainer reduces the
loss over ``dp_shard_cp``), so its gradient is its batch's mean gradient whatever the number of
replicas. Anchors and outer momentum are checkpointed (``state_dict``) with the inner optimizer
state of every replica (``ndtrain.train.trainer``). Parameters are this rank's local tensors (a TP /
PP shard, DTensor local shards): the averaging pairs the same shard across replicas.
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
    """The outer loop of DiLoCo for one rank (see the module docstring).

    Args:
        model: this rank's (parallelized) model; its parameters at construction are the anchor.
        mesh: the layout; the outer all-reduce runs over ``mesh.group("dp_replicate")``.
        local_sgd_steps: H, inner steps per outer step (>= 1).
        outer_lr, outer_momentum: the outer SGD; Nesterov when momentum > 0.
    Communication: one all-reduce of every local parameter (in its dtype) per H steps, counted on
    the ``dp_replicate`` axis.
    """

    def __init__(self, model: nn.Module, mesh: Mesh, local_sgd_steps: int, outer_lr: float,
                 outer_momentum: float):
        self.group = mesh.group("dp_replicate")
        self.h = local_sgd_steps
        seen: set[int] = set()
        self.names, self.params = [], []
        for name, p in model.named_parameters():
            if p.requires_grad and id(p) not in seen:  # tied weights: once
                seen.add(id(p))
                self.names.append(name)
                self.params.append(p)
        self.anchor = [_local(p).detach().clone() for p in self.params]
        self.outer = torch.optim.SGD(self.anchor, lr=outer_lr, momentum=outer_momentum,
                                     nesterov=outer_momentum > 0)
        self.outer_steps = 0

    def after_inner_step(self, step: int) -> bool:
        """Call after optimizer step ``step`` (1-based, counting skipped steps too, so every rank
        agrees): every H-th step runs the outer step (collective). Returns whether it did."""
        if step % self.h:
            return False
        self.outer_step()
        return True

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

    def reset_anchor(self) -> None:
        """The current parameters become the anchor (after loading weights); momentum restarts."""
        for a, p in zip(self.anchor, self.params):
            a.copy_(_local(p))
        self.outer.state.clear()

    def state_dict(self) -> dict:
        """``{"anchor": {name: tensor}, "momentum": {name: tensor}}`` (local tensors; identical on
        every replica, so a checkpoint keeps one copy). Momentum buffers exist after the first outer
        step; before it they are saved as zeros, which SGD's first step treats the same way only if
        absent -- ``load_state_dict`` therefore restores them only when ``outer_steps`` > 0."""
        mom = {}
        for name, a in zip(self.names, self.anchor):
            buf = self.outer.state.get(a, {}).get("momentum_buffer")
            mom[name] = buf if buf is not None else torch.zeros_like(a)
        return {"anchor": dict(zip(self.names, self.anchor)), "momentum": mom,
                "outer_steps": torch.tensor(self.outer_steps, dtype=torch.int64)}

    def load_state_dict(self, sd: dict) -> None:
        """Restore what ``state_dict`` gave (the tensors of a loaded template, in place or not)."""
        self.outer_steps = int(sd["outer_steps"])
        self.outer.state.clear()
        for name, a in zip(self.names, self.anchor):
            a.copy_(sd["anchor"][name])
            if self.outer_steps > 0 and self.outer.defaults["momentum"] > 0:
                self.outer.state[a] = {"momentum_buffer": sd["momentum"][name].clone()}
