"""Mixed precision (Micikevicius et al. 2018): compute dtypes and dynamic loss scaling for fp16.

``float64`` / ``float32``: no autocast. ``bfloat16``: fp32 masters, bf16 compute under autocast
(DDP keeps fp32 parameters; ZeRO-1/2 bf16 parameters with fp32 master shards; ZeRO-3 gathers bf16
copies); gradients reduced in ``parallel.grad_reduce_dtype`` and accumulated in fp32. ``float16``:
as bf16, plus a loss scale S against its 5-bit exponent's underflow: overflow flags are
max-reduced over the mesh by the caller's ``reduce_max`` (no process groups here), every rank then
skips the step (no LR advance) and halves S; S doubles after ``loss_scale_growth_interval`` good
steps."""
from __future__ import annotations

from collections.abc import Callable

import torch

_MIXED = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def compute_dtype(dtype: str) -> torch.dtype | None:
    """Autocast / gathered-parameter dtype for ``training.dtype`` (None = no mixed precision)."""
    return _MIXED.get(dtype)


def grad_reduce_dtype(dtype: str, grad_reduce: str) -> torch.dtype | None:
    """``parallel.grad_reduce_dtype`` under mixed precision, else None (the parameters' dtype)."""
    return getattr(torch, grad_reduce) if dtype in _MIXED else None


class LossScaler:
    """Dynamic fp16 loss scale (the rules of ``torch.amp.GradScaler``): ``scale`` starts at
    ``init_scale``, times ``growth_factor`` after ``growth_interval`` finite steps, times
    ``backoff_factor`` on overflow; ``good_steps`` counts finite steps since the last change."""

    def __init__(self, init_scale: float = 2.0**16, growth_interval: int = 2000,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5):
        self.scale = float(init_scale)
        self.growth_interval = growth_interval
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.good_steps = 0

    @torch.no_grad()
    def unscale_and_check(self, grads: list[torch.Tensor],
                          reduce_max: Callable[[torch.Tensor], None] | None = None) -> bool:
        """Multiply ``grads`` by 1/S in place; True if every rank's are finite. ``reduce_max`` max-reduces
        the (1,) float32 flag over the mesh (a collective); None in one process."""
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
