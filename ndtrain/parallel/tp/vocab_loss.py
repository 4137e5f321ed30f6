"""Vocab-parallel cross-entropy (Megatron-LM, Shoeybi et al. 2019): the loss over logits whose
vocabulary is split across the ``tp`` axis, without ever gathering the full (N, V) logits.

Each rank holds logits (N, Vp / tp) for vocabulary rows ``[r * Vp/tp, (r+1) * Vp/tp)``; rows at or
beyond the real vocabulary size V (padding) are masked to -inf, so they get zero probability and
zero gradient. Per token:

    m      = max over all ranks of the local maxima          (all-reduce MAX, N values)
    Z, z_y = sum exp(x - m) and the target logit x_y - m     (one all-reduce SUM of 2N values)
    loss   = log Z - z_y                                     (0 where label == ignore_index)
    dloss/dx = softmax(x) - onehot(y)                        (local; no communication)

The slow twin is ``F.cross_entropy`` on the gathered logits (``tests/parallel/test_tp.py``).
Communication per call: 2 (N-1)/N * 3 N * b bytes per rank (b = bytes of the compute dtype).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ndtrain.mesh import AxisGroup
from ndtrain.parallel import comm


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy over vocabulary-split logits.

    fwd: all-reduce MAX + all-reduce SUM over ``group`` (see module docstring), bwd: local.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, group: AxisGroup, vocab_start: int,
                vocab_size: int, ignore_index: int) -> torch.Tensor:
        cdt = torch.float64 if logits.dtype == torch.float64 else torch.float32
        x = logits.to(cdt)  # (N, Vl)
        vl = x.shape[-1]
        if vocab_start + vl > vocab_size:  # padded rows here (decided on the host: no device sync)
            pad = vocab_start + torch.arange(vl, device=x.device) >= vocab_size  # (Vl,)
            x = x.masked_fill(pad, float("-inf"))
        m = x.max(dim=-1).values  # (N,); a rank holding only padding gives -inf here
        comm.all_reduce(m, group, op=dist.ReduceOp.MAX)
        x = x - m.unsqueeze(-1)
        e = x.exp()  # (N, Vl)
        valid = labels != ignore_index
        local = labels - vocab_start
        mine = valid & (local >= 0) & (local < vl)
        idx = local.masked_fill(~mine, 0).unsqueeze(-1)  # (N, 1)
        stats = torch.stack([e.sum(-1), x.gather(-1, idx).squeeze(-1).masked_fill(~mine, 0.0)])
        comm.all_reduce(stats, group)  # (2, N): Z and z_y summed over ranks
        z, zy = stats
        loss = (z.log() - zy).masked_fill(~valid, 0.0)
        ctx.save_for_backward(e.div_(z.unsqueeze(-1)), idx, mine, valid)
        ctx.out_dtype = logits.dtype
        return loss.to(logits.dtype)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        softmax, idx, mine, valid = ctx.saved_tensors
        grad = softmax.clone()  # (N, Vl)
        grad.scatter_add_(-1, idx, -mine.to(grad.dtype).unsqueeze(-1))
        grad.mul_((g.to(grad.dtype) * valid).unsqueeze(-1))
        return grad.to(ctx.out_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, group: AxisGroup,
                                 vocab_size: int, ignore_index: int = -100) -> torch.Tensor:
    """Per-token loss (N,) from this rank's logits (N, Vp / tp) and labels (N,) int64.

    ``vocab_size`` is the real V; this rank's rows start at ``group.rank * Vp / tp``. Labels equal
    to ``ignore_index`` give 0 loss and 0 gradient. A size-1 group with V == Vp reduces to
    ``F.cross_entropy(..., reduction="none")``.
    """
    vocab_start = group.rank * logits.shape[-1]
    return VocabParallelCrossEntropy.apply(logits, labels, group, vocab_start, vocab_size, ignore_index)
