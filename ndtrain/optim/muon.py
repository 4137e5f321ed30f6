"""Muon (Jordan et al. 2024) for the hidden weight matrices, AdamW for the rest, in one optimizer.

Per hidden matrix W (m, n) with gradient G, momentum mu, learning rate lr, weight decay wd:

    B <- mu B + G                      (momentum buffer, SGD form as in Moonlight)
    U  = G + mu B                      (Nesterov)
    O  = NewtonSchulz(U, ns_steps)     (``ndtrain.ops.newton_schulz``: ~ the polar factor of U)
    W <- (1 - lr wd) W - lr s(m, n) O  (decoupled weight decay)

``s(m, n)``: ``"moonlight"`` 0.2 sqrt(max(m, n)) (Liu et al. 2025, "Muon is Scalable for LLM
Training": the update's RMS matches AdamW's ~0.2, so AdamW's lr and weight decay carry over) or
``"original"`` sqrt(max(1, m / n)) (Jordan et al.; wants its own, larger lr, ~0.02). A stacked
expert weight (E, F, C) is E matrices, each orthogonalised alone (``batched``).

Which parameters are matrices (``muon_param_kind``): 2-D parameters, and stacked experts
(3-D, under a module named ``experts``); never the embeddings, the output head, routers or convolutions
(``training.muon_adamw_patterns``), nor 1-D parameters (norms, biases). Those get AdamW, the same
update as ``ndtrain.optim.build_optimizer`` (decay on >= 2-D, none on 1-D), at ``training.lr``.

Everything but ``O`` is elementwise. ``orthogonalize`` is injected: one process runs
``newton_schulz`` on each whole tensor; sharded layouts (``ndtrain.parallel.muon``) assemble each
matrix from its shards, orthogonalise it once and hand back every rank's part, so the step is the
single-process step. State per parameter: ``step``, and ``momentum_buffer`` (Muon) or ``exp_avg``
/ ``exp_avg_sq`` (AdamW), created when the optimizer is (state dicts exist before step 1).
"""
from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable

import torch

from ndtrain.ops.newton_schulz import newton_schulz, ns_flops

MUON_SCALES = ("moonlight", "original")
EXPERT_MODULE = "experts"  # a name part: stacked (E, F, C) expert weights, one matrix per expert


def muon_param_kind(name: str, shape, patterns: str) -> str:
    """``"muon"`` for a hidden matrix (2-D, or a 3-D stacked expert weight), else ``"adamw"``;
    ``patterns``: comma-separated fnmatch patterns of names that always get AdamW."""
    if any(fnmatch.fnmatchcase(name, pat.strip()) for pat in patterns.split(",") if pat.strip()):
        return "adamw"
    if len(shape) == 2 or (len(shape) == 3 and EXPERT_MODULE in name.split(".")):
        return "muon"
    return "adamw"


def update_scale(m: int, n: int, scale: str) -> float:
    """The factor ``s(m, n)`` of an (m, n) matrix's orthogonalised update (module docstring)."""
    if scale == "moonlight":
        return 0.2 * math.sqrt(max(m, n))
    if scale == "original":
        return math.sqrt(max(1.0, m / n))
    raise ValueError(f"muon scale {scale!r} is not one of {MUON_SCALES}")


def ns_dtype(t: torch.Tensor) -> torch.dtype:
    """bfloat16 on GPU (as the reference does), the tensor's own dtype on CPU."""
    return torch.bfloat16 if t.is_cuda else t.dtype


def local_orthogonalize(params: list[torch.Tensor], updates: list[torch.Tensor], steps: int) -> list[torch.Tensor]:
    """One process: every tensor is whole; (E, F, C) batches are orthogonalised per expert."""
    return [newton_schulz(u, steps, ns_dtype(u)) for u in updates]


class Muon(torch.optim.Optimizer):
    """Muon on the groups with ``kind == "muon"``, AdamW on those with ``kind == "adamw"``.

    Args:
        groups: param groups, each with ``kind`` and ``weight_decay`` (and ``lr`` if it differs).
        lr: AdamW groups' lr; ``muon_lr`` the Muon groups' (both scaled by the LR schedule).
        momentum, ns_steps, scale: Muon's (module docstring).
        betas, eps: AdamW's.
        shapes: ``{id(param): (m, n)}`` of the *whole* matrix a (sharded) parameter belongs to, for
            ``update_scale``; default each parameter's last two dims.
        orthogonalize: ``f(params, updates, steps) -> orthogonalised updates`` (same shapes as
            ``updates``: what this rank holds); default ``local_orthogonalize``.
    """

    def __init__(self, groups: list[dict], *, lr: float, muon_lr: float, momentum: float = 0.95,
                 ns_steps: int = 5, scale: str = "moonlight", betas=(0.9, 0.95), eps: float = 1e-8,
                 shapes: dict[int, tuple[int, int]] | None = None,
                 orthogonalize: Callable | None = None):
        update_scale(1, 1, scale)  # ValueError for an unknown scale
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": 0.0, "momentum": momentum,
                    "ns_steps": ns_steps, "scale": scale, "kind": "adamw"}
        groups = [dict(g, lr=g.get("lr", muon_lr if g["kind"] == "muon" else lr)) for g in groups]
        super().__init__(groups, defaults)
        self.shapes = shapes or {}
        self.orthogonalize = orthogonalize or local_orthogonalize
        self.qk_clip = None  # apply() after each step, reset() on zero_grad (ndtrain.parallel.muon.qk_clip)
        for g in self.param_groups:  # eager state (see module docstring)
            for p in g["params"]:
                st = self.state[p]
                st["step"] = torch.zeros((), dtype=torch.float64)
                keys = ("momentum_buffer",) if g["kind"] == "muon" else ("exp_avg", "exp_avg_sq")
                for k in keys:
                    st[k] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def matrix_shape(self, p: torch.Tensor) -> tuple[int, int]:
        return self.shapes.get(id(p), tuple(p.shape[-2:]))

    def ns_flops_per_step(self) -> int:
        """Newton-Schulz FLOPs this rank runs per step (HFU counts them, MFU does not): the
        orthogonaliser's ``flops_per_step`` where it has one (sharded layouts), else every Muon
        tensor here, each (E, F, C) batch as E matrices."""
        steps = next((g["ns_steps"] for g in self.param_groups if g["kind"] == "muon"), 0)
        if hasattr(self.orthogonalize, "flops_per_step"):
            return self.orthogonalize.flops_per_step(steps)
        return sum(ns_flops(*p.shape[-2:], steps, p.shape[0] if p.dim() == 3 else 1)
                   for g in self.param_groups if g["kind"] == "muon" for p in g["params"])

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter with a gradient (all of them on every rank of a sharded
        layout: the orthogonalisation is collective)."""
        loss = closure() if closure is not None else None
        for g in self.param_groups:
            params = [p for p in g["params"] if p.grad is not None]
            if params:
                (self._muon if g["kind"] == "muon" else self._adamw)(g, params)
        if self.qk_clip is not None:  # on the updated weights, before a layout's post-step gather
            self.qk_clip.apply()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Also re-arms QK-clip's logit maxima: a skipped step's (maybe non-finite) ones are dropped."""
        super().zero_grad(set_to_none=set_to_none)
        if self.qk_clip is not None:
            self.qk_clip.reset()

    def _muon(self, g: dict, params: list[torch.Tensor]) -> None:
        mu, lr, wd = g["momentum"], g["lr"], g["weight_decay"]
        grads = [p.grad for p in params]
        bufs = [self.state[p]["momentum_buffer"] for p in params]
        for p in params:
            self.state[p]["step"] += 1
        torch._foreach_mul_(bufs, mu)
        torch._foreach_add_(bufs, grads)
        nesterov = torch._foreach_add(grads, bufs, alpha=mu)
        ortho = self.orthogonalize(params, nesterov, g["ns_steps"])
        if wd:
            torch._foreach_mul_(params, 1.0 - lr * wd)
        for p, o in zip(params, ortho):
            p.add_(o, alpha=-lr * update_scale(*self.matrix_shape(p), g["scale"]))

    def _adamw(self, g: dict, params: list[torch.Tensor]) -> None:
        """AdamW (Loshchilov & Hutter 2019), torch.optim.AdamW's update written out."""
        (b1, b2), lr, wd, eps = g["betas"], g["lr"], g["weight_decay"], g["eps"]
        grads = [p.grad for p in params]
        m = [self.state[p]["exp_avg"] for p in params]
        v = [self.state[p]["exp_avg_sq"] for p in params]
        for p in params:
            self.state[p]["step"] += 1
        t = float(self.state[params[0]]["step"])  # every parameter of a group steps together
        if wd:
            torch._foreach_mul_(params, 1.0 - lr * wd)
        torch._foreach_lerp_(m, grads, 1.0 - b1)
        torch._foreach_mul_(v, b2)
        torch._foreach_addcmul_(v, grads, grads, value=1.0 - b2)
        bc1, bc2 = 1.0 - b1 ** t, 1.0 - b2 ** t
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, math.sqrt(bc2))
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, m, denom, value=-lr / bc1)


def muon_groups(named_params, tcfg, shapes: dict[str, tuple] | None = None) -> list[dict]:
    """AdamW decay (>= 2-D), AdamW no-decay (1-D) and Muon groups of ``named_params`` (names are
    the single-process names; ``shapes``: their global shapes where the tensors are shards)."""
    decay, no_decay, matrices, seen = [], [], [], set()
    for name, p in named_params:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        shape = (shapes or {}).get(name, tuple(p.shape))
        if muon_param_kind(name, shape, tcfg.muon_adamw_patterns) == "muon":
            matrices.append(p)
        else:
            (decay if len(shape) >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": tcfg.weight_decay, "kind": "adamw"}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0, "kind": "adamw"})
    if matrices:
        groups.append({"params": matrices, "weight_decay": tcfg.weight_decay, "kind": "muon"})
    return groups


def build_muon(named_params, tcfg, shapes: dict[str, tuple] | None = None,
               orthogonalize: Callable | None = None, lr_factor: float = 1.0) -> Muon:
    """``Muon`` over ``named_params`` from ``training.*`` (``muon_lr`` 0 = ``lr``). ``shapes``:
    global shapes by name for sharded tensors; ``orthogonalize``: see ``Muon``; ``lr_factor``: the
    Muon groups' LR multiplier (``ndtrain.optim.mup.hidden_lr_factor``, ``training.mup_base_width``)."""
    named_params = list(named_params)
    groups = muon_groups(named_params, tcfg, shapes)
    for g in groups:
        if g["kind"] == "muon":
            g["lr"] = (tcfg.muon_lr or tcfg.lr) * lr_factor
    by_id = {}
    for name, p in named_params:
        shape = (shapes or {}).get(name, tuple(p.shape))
        if len(shape) >= 2:
            by_id[id(p)] = tuple(shape[-2:])
    return Muon(groups, lr=tcfg.lr, muon_lr=tcfg.muon_lr or tcfg.lr, momentum=tcfg.muon_momentum,
                ns_steps=tcfg.muon_ns_steps, scale=tcfg.muon_scale, betas=(tcfg.beta1, tcfg.beta2),
                eps=tcfg.eps, shapes=by_id, orthogonalize=orthogonalize)
