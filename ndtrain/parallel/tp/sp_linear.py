"""Column-parallel matmuls on a sequence-parallel gathered input that save only this rank's shard
for backward and all-gather it again there (Korthikanti et al. 2022, section 4.2.2; Megatron-LM's
``LinearWithGradAccumulationAndAsyncCommunication`` under sequence parallel).

Why: under SP a region's input is all-gathered along T to (B, T, C) before its column-parallel
linears; a plain ``F.linear`` keeps that whole (B, T, C) tensor alive until backward (for the weight
gradient), tp times the (B, T/tp, C) shard the rank already has. Here the forward keeps the shard
and the backward re-gathers it: one more all-gather per region per microbatch, counted on the
group's axis by ``ndtrain.parallel.comm``.

How a region's linears share one backward gather: ``gather_input`` (the region's f) tags the
gathered tensor with a ``_Gathered`` record (the shard and a shared cache); each ``linear`` on that
tensor saves the shard (``save_for_backward``, so activation checkpointing and saved-tensor hooks
see it) and registers as a user of the cache; the first backward gathers, the last frees.
A tensor without the tag (no SP, or model code that reshaped the gathered input) takes the plain
``F.linear`` path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ndtrain.mesh import AxisGroup
from ndtrain.parallel.comm import gather_dim

GATHERED_ATTR = "ndtrain_sp_gathered"  # on the gathered tensor: its _Gathered record
REGATHER = True  # False: keep the gathered input as plain F.linear does (the reference in tests)


class _Cache:
    """The re-gathered input of one region's backward, shared by its linears (``users`` pending)."""

    def __init__(self):
        self.users, self.full = 0, None


class _Gathered:
    """What the region's gather leaves on its output: the shard (B, T/tp, C), the group, the dim
    gathered, and the backward cache. Holds the shard only while the gathered tensor lives."""

    def __init__(self, shard: torch.Tensor, group: AxisGroup, dim: int):
        self.shard, self.group, self.dim, self.cache = shard, group, dim, _Cache()
        self.casts: dict[torch.dtype, torch.Tensor] = {}

    def cast(self, dt: torch.dtype) -> torch.Tensor:
        """The shard in ``dt``, cast once for all the region's linears (autocast: one bf16 copy)."""
        if dt not in self.casts:
            self.casts[dt] = self.shard.detach().to(dt)
        return self.casts[dt]


def tag_gathered(full: torch.Tensor, shard: torch.Tensor, group: AxisGroup, dim: int) -> torch.Tensor:
    """Mark ``full`` (the all-gather of ``shard`` along ``dim``) for ``linear``; returns ``full``."""
    if REGATHER:
        setattr(full, GATHERED_ATTR, _Gathered(shard, group, dim))
    return full


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


class _LinearSavingShard(torch.autograd.Function):
    """y = full @ w.T with only the shard saved. fwd: full (..., in), w (out, in) -> (..., out);
    bwd: d full = g @ w (summed with the region's other users by autograd, then reduce-scattered
    by the gather's own backward), d w = g.T @ all-gather(shard), the gather shared by the region;
    each only when the running backward pass needs it (``_wanted``)."""

    @staticmethod
    def forward(ctx, full, w, rec: _Gathered):
        dt = _compute_dtype(full)  # autocast's cast, done here: the shard is saved in that dtype
        with torch.autocast(full.device.type, enabled=False):
            wc, sc = w.to(dt), rec.cast(dt)
            y = F.linear(full.to(dt), wc)
        ctx.save_for_backward(sc, wc)
        ctx.group, ctx.dim, ctx.cache = rec.group, rec.dim, rec.cache
        ctx.dtypes = (full.dtype, w.dtype)
        rec.cache.users += 1
        return y

    @staticmethod
    def backward(ctx, g):
        sc, wc = ctx.saved_tensors
        g = g.to(wc.dtype)
        d_full = (g @ wc).to(ctx.dtypes[0]) if _wanted(ctx, 0) else None
        d_w = None
        if _wanted(ctx, 1):  # not in a zero-bubble B pass: no gather, no matmul there
            cache = ctx.cache
            full = cache.full if cache.full is not None else gather_dim(sc, ctx.dim, ctx.group)
            cache.users -= 1
            cache.full = full if cache.users > 0 else None  # the last user frees it
            d_w = (g.reshape(-1, g.shape[-1]).t() @ full.reshape(-1, full.shape[-1])).to(ctx.dtypes[1])
        return d_full, d_w, None


def _wanted(ctx, i: int) -> bool:
    """Whether this backward pass uses input ``i``'s gradient: ``needs_input_grad`` is fixed at
    forward time, so also ask the engine whether it will run that input's node (a split backward's
    B pass asks for activation gradients only, its W pass for weight gradients only)."""
    if not ctx.needs_input_grad[i]:
        return False
    node = ctx.next_functions[i][0]
    if node is None:
        return True
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:  # a leaf under autograd.grad cannot be asked: compute it
        return True


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, w)`` (bias-free; x (..., in), w (out, in) -> (..., out)), saving only the
    shard when ``x`` is a tagged SP gather and gradients are on; else plain ``F.linear``."""
    rec = getattr(x, GATHERED_ATTR, None)
    if rec is None or not torch.is_grad_enabled():
        return F.linear(x, w)
    # the view gives w a non-leaf node that the engine can be asked about (``_wanted``)
    return _LinearSavingShard.apply(x, w.view_as(w), rec)
