"""Mixed precision: compute dtypes and dynamic loss scaling for fp16.

``training.dtype`` picks the recipe (Micikevicius et al. 2018, "Mixed Precision Training"):

* ``float64`` / ``float32``: everything in that dtype, no autocast.
* ``bfloat16``: fp32 master weights, bf16 compute under ``torch.autocast``. Plain data parallel keeps
  fp32 parameters (autocast casts them per op); ZeRO-1/2 keep bf16 model parameters and fp32 master
  shards; ZeRO-3 gathers bf16 copies of fp32 shards. Gradients are reduced in
  ``parallel.grad_reduce_dtype`` (fp32 default, bf16 halves the traffic) and accumulated in fp32.
* ``float16``: as bf16 but fp16 compute, whose 5-bit exponent underflows small gradients, so the
  loss is multiplied by a scale S before backward and gradients by 1/S after (dynamic loss scaling,
  ``LossScaler``).

Dynamic loss scaling: after the gradient sync, each rank checks its gradients for inf / NaN and the
flags are max-reduced over every rank of the mesh (by the caller's ``reduce_max``, e.g.
``ndtrain.parallel.dp.grad_sync.max_over_mesh(mesh)``; this module never touches process groups),
so all ranks agree. On overflow every rank skips the
optimizer step (and the LR schedule does not advance) and halves S; after
``loss_scale_growth_interval`` consecutive good steps S doubles.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

_MIXED = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def compute_dtype(dtype: str) -> torch.dtype | None:
    """Autocast / gathered-parameter dtype for ``training.dtype`` (None = no mixed precision)."""
    return _MIXED.get(dtype)


def grad_reduce_dtype(dtype: str, grad_reduce: str) -> torch.dtype | None:
    """Dtype of gradient reductions: ``parallel.grad_reduce_dtype`` under mixed precision, else
    None (the parameters' dtype)."""
    return getattr(torch, grad_reduce) if dtype in _MIXED else None


class LossScaler:
    """Dynamic loss scale for fp16 (Micikevicius et al. 2018; the rules of torch.amp.GradScaler).

    Args:
        init_scale: S at the start.
        growth_interval: consecutive finite steps after which S doubles.
        growth_factor / backoff_factor: multipliers of S on growth / overflow.
    Attributes: ``scale`` (float), ``good_steps`` (finite steps since the last change).
    """

    def __init__(self, init_scale: float = 2.0**16, growth_interval: int = 2000,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5):
        self.scale = float(init_scale)
        self.growth_interval = growth_interval
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.good_steps = 0

    @torch.no_grad()
    def unscale_and_check(self, grads: list[torch.Tensor],
                          reduce_max: Callable[[torch.Tensor], None] | None = None) -> bool:
        """Multiply ``grads`` in place by 1/S; return True if every gradient of every rank is finite.

        ``reduce_max(flag)`` max-reduces the (1,) float32 overflow flag in place over every rank
        of the mesh (a collective: every rank calls it); None in a single process.
        """
        found = torch.zeros(1, dtype=torch.float32, device=grads[0].device if grads else "cpu")
        for g in grads:
            if not torch.isfinite(g).all():
                found.fill_(1.0)
                break
        if reduce_max is not None:
            reduce_max(found)
        ok = found.item() == 0.0
        if ok:
            inv = 1.0 / self.scale
            for g in grads:
                g.mul_(inv)
        return ok

    def update(self, ok: bool) -> None:
        """Back off after an overflow; grow after ``growth_interval`` good steps in a row."""
        if not ok:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, sd: dict) -> None:
        self.scale, self.good_steps = float(sd["scale"]), int(sd["good_steps"])


def build_loss_scaler(tcfg) -> LossScaler | None:
    """A ``LossScaler`` for ``training.dtype=float16``, else None."""
    if tcfg.dtype != "float16":
        return None
    return LossScaler(tcfg.loss_scale_init, tcfg.loss_scale_growth_interval)
