"""QK-clip (MuonClip; Kimi Team 2025, "Kimi K2: Open Agentic Intelligence"): after each optimizer
step, every attention head whose largest pre-softmax logit in that step exceeded ``tau`` has its
query and key weights scaled down so that the logit would be ``tau``.

Per query head h with step max ``S_h`` (``Attention.logit_max``: over the global batch, all causal
pairs, ``q_t . k_s / sqrt(D)``): ``gamma_h = min(1, tau / S_h)``. Kimi K2's rule for MHA scales
W_q and W_k of head h by ``sqrt(gamma_h)`` each. Under GQA a key head g is shared by the query heads
of its group, so the rule here is: W_k rows of g by ``sqrt(min_{h in g} gamma_h)``, W_q rows of h by
``gamma_h / sqrt(min_{h in g} gamma_h)``: every head's logits are scaled by exactly its own
``gamma_h`` (heads under tau keep theirs), and for MHA it is Kimi's rule. RoPE is a rotation, so
the logits scale as the weights do. MLA, qk-norm, sliding-window and sparse attention are refused
(``rules.check_qk_clip``).

Global: ``S_h`` is max-reduced over the ranks that hold the same heads on other tokens (``group``:
dp_replicate x dp_shard, or one DiLoCo replica; cp is refused), so every layout clips as one
process does. tp ranks hold other heads (each their own slice's), pp stages other layers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ndtrain.parallel import comm


def qk_scales(gamma: torch.Tensor, n_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gamma (H,) in (0, 1] -> (query head scales (H,), key head scales (G,)), G = ``n_kv``
    dividing H; query head h belongs to key head h // (H / G)."""
    kmin = gamma.view(n_kv, -1).amin(dim=1)  # (G,)
    sk = kmin.sqrt()
    return gamma / sk.repeat_interleave(gamma.numel() // n_kv), sk


@dataclass
class Target:
    """One attention module and what this rank holds of its wq / wk: ``wq``, ``wk`` (held tensors,
    rows along dim 0), ``q_row0`` / ``k_row0`` (the held block's first row in the module's own,
    tp-local matrix), ``q_rows`` / ``k_rows`` (that matrix's real row count: rows past it are ZeRO
    padding), ``head_dim``."""

    module: torch.nn.Module
    wq: torch.Tensor
    wk: torch.Tensor
    q_row0: int
    k_row0: int
    q_rows: int
    k_rows: int
    head_dim: int


def _scale_rows(w: torch.Tensor, row0: int, rows: int, head_scale: torch.Tensor, d: int) -> None:
    idx = torch.arange(row0, row0 + w.shape[0], device=w.device)
    s = torch.ones(w.shape[0], dtype=w.dtype, device=w.device)
    real = idx < rows
    s[real] = head_scale.to(w.dtype)[idx[real] // d]
    w.mul_(s.view(-1, *([1] * (w.dim() - 1))))


class QKClip:
    """``start()`` arms every target's recording (an empty ``logit_max``), ``apply()`` clips after an
    optimizer step and re-arms, ``reset()`` re-arms (a skipped step). ``clipped``: heads clipped by
    the last ``apply``; ``last_max``: their global maxima ({module index: (H,)})."""

    def __init__(self, tau: float, targets: list[Target], group):
        self.tau, self.targets, self.group = tau, targets, group
        self.clipped, self.last_max = 0, {}
        self.reset()

    def reset(self) -> None:
        for t in self.targets:
            t.module.logit_max = t.wq.new_empty(0)

    @torch.no_grad()
    def apply(self) -> None:
        maxes = [t.module.logit_max for t in self.targets]
        if any(m.numel() == 0 for m in maxes):
            raise RuntimeError("qk_clip: an attention layer ran no training forward this step; nothing is clipped")
        flat = torch.cat(maxes)
        comm.all_reduce(flat, self.group, op=dist.ReduceOp.MAX)  # every token of the step, every rank
        self.clipped, self.last_max, off = 0, {}, 0
        for i, t in enumerate(self.targets):
            m = flat[off:off + maxes[i].numel()]
            off += m.numel()
            self.last_max[i] = m.clone()
            gamma = (self.tau / m).clamp(max=1.0)
            self.clipped += int((gamma < 1).sum())
            sq, sk = qk_scales(gamma, t.k_rows // t.head_dim)
            _scale_rows(t.wq, t.q_row0, t.q_rows, sq, t.head_dim)
            _scale_rows(t.wk, t.k_row0, t.k_rows, sk, t.head_dim)
        self.reset()
