"""Learning-rate transfer across widths (muP-style; Yang et al. 2022, "Tensor Programs V"; for
Muon, Bernstein et al. 2023, "A Spectral Condition for Feature Learning"): ``training.mup_base_width``
= B > 0 is the ``model.dim`` the LRs were tuned at; a run of width W = ``model.dim`` scales the
peak LR of its *hidden matrices* (``muon_param_kind`` "muon": attention / MLP / expert / mixer
projections) by ``hidden_lr_factor``, so that a hidden matrix's update changes its output by the
same amount at every width:

* AdamW: ``B / W``. Adam's update has entries ~lr, and its spectral norm grows ~W for the
  low-rank gradients of a layer, so the lr must shrink as 1/W (muP's Adam rule for hidden weights).
* Muon, ``muon_scale: moonlight``: ``sqrt(B / W)``. The update is ``lr 0.2 sqrt(max(m, n)) O``
  with ``O`` orthogonal (spectral norm ~1), so its spectral norm grows as sqrt(W).
* Muon, ``muon_scale: original``: 1. ``sqrt(max(1, m / n))`` already gives the spectral condition's
  ``sqrt(fan_out / fan_in)``, a width-free ratio.

Everything else (embeddings, the output head, routers, convolutions, norms, biases) keeps
``training.lr``. The init of the hidden matrices is rescaled by ``hidden_init_factor`` =
``sqrt(B / W)`` (muP's hidden init variance ~ 1 / fan_in; for Muon the spectral condition's init
norm ~ sqrt(fan_out / fan_in), which a Gaussian of std ~ 1 / sqrt(W) meets): ``init_std`` is the
base width's std. Embeddings, the head and the router keep ``init_std``; the output multiplier of
full muP is not applied.
"""
from __future__ import annotations

import math

import torch

from ndtrain.optim.muon import muon_param_kind


def hidden_init_factor(width: int, base: int) -> float:
    """The hidden matrices' init-std multiplier ``sqrt(base / width)``; 1 when ``base`` is 0 (off)."""
    return math.sqrt(base / width) if base else 1.0


def hidden_lr_factor(optimizer: str, scale: str, width: int, base: int) -> float:
    """The hidden matrices' LR multiplier (module docstring); 1 when ``base`` is 0 (off)."""
    if not base:
        return 1.0
    if optimizer == "adamw":
        return base / width
    return math.sqrt(base / width) if scale == "moonlight" else 1.0


def split_hidden_adamw(opt: torch.optim.Optimizer, named, tcfg, width: int) -> None:
    """Move the hidden matrices of an AdamW ``opt``'s decayed group (group 0) into a group of their own
    with ``lr * hidden_lr_factor`` (called before the LR scheduler is built, which reads each
    group's lr as its peak). ``named``: ``(single-process name, held tensor, global shape)``."""
    factor = hidden_lr_factor("adamw", tcfg.muon_scale, width, tcfg.mup_base_width)
    hidden = {id(p) for n, p, shape in named if len(shape) >= 2
              and muon_param_kind(n, shape, tcfg.muon_adamw_patterns) == "muon"}
    g0 = opt.param_groups[0]
    moved = [p for p in g0["params"] if id(p) in hidden]
    if not moved:
        return
    g0["params"] = [p for p in g0["params"] if id(p) not in hidden]
    opt.add_param_group({**{k: v for k, v in g0.items() if k != "params"}, "params": moved,
                         "lr": g0["lr"] * factor})
