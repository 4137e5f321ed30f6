"""Tensor-parallel plan entries of DeepSeek's MLA attention and MTP modules (DeepSeek-V2 / V3).

MLA (``ndtrain.model.mla``), split by heads as Megatron-Core's ``MLASelfAttention`` does:

* the per-head projections are split: ``wq_b`` (or the full-rank ``wq``) and ``wkv_b``
  column-parallel (their rows are head-major: [q_nope | q_rope] and [k_nope | v] of head 0, then
  head 1, ...), ``wo`` row-parallel; each rank attends with its H / tp heads;
* the latent path is replicated on every rank: ``wq_a`` / ``q_norm`` and ``wkv_a`` / ``kv_norm``
  (whose output includes the RoPE key shared by all heads). Megatron's f sits between the two
  parts, on the concatenated [query input | kv latent | RoPE key] (``MLAttention.enter_heads``),
  instead of on the block's input: its backward all-reduce completes the latent gradients, so the
  replicated down-projections and norms get whole, identical gradients with no weight all-reduce,
  and the all-reduced activation is d_q + d_c + d_r wide instead of C (DeepSeek-V3: 2112 vs 7168).
* with sequence parallel the residual stream is (B, T / tp, C): the down-projections and norms run
  on this rank's tokens (1 / tp of their work), f all-gathers the latents along T (backward:
  reduce-scatter), and the replicated latent weights get their per-token gradients summed over tp
  (``CopyWeightToTP``, as SP does for the block norms).

MTP modules (``ndtrain.model.mtp``): each depth's ``block`` is planned like the decoder blocks (the
``layers.*`` entries, its token mixer by ``mixer_entries``); ``hnorm``, ``enorm``, ``norm`` and the
(C, 2C) ``proj`` are replicated. Without SP their inputs and output gradients are the replicated
residual stream's, so their gradients are whole on every rank; with SP they see this rank's tokens
and their gradients are summed over tp. ``proj`` is kept whole rather than split (Megatron-Core
splits it column-wise and gathers): at 2 C^2 per depth it is one block's attention projection,
and whole it needs no collective. With SP the MTP depths run on all T positions with the shifted
tokens (the model's ``mtp_shift`` hook), since a rank's T / tp residual shard cannot be truncated;
so do they without SP when the MTP blocks are MoE (each tp rank routes a T / tp piece).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ndtrain.model.mla import MLAttention
from ndtrain.model.moe_balance import moe_layers
from ndtrain.model.mtp import SHIFT_ATTR, shift_left
from ndtrain.parallel.tp.collectives import CopyWeightToTP
from ndtrain.parallel.tp.layers import RegionInput, SequenceParallelNorm
from ndtrain.parallel.tp.plan import Colwise, Rowwise, TPContext


class ReplicatedLinear(nn.Module):
    """A bias-free linear kept whole on every tp rank but applied to this rank's tokens only
    (sequence parallel): the weight passes through ``CopyWeightToTP`` (fwd identity, bwd all-reduce
    over tp in ``reduce_dtype``), so its gradient covers every token. x (..., in) -> (..., out)."""

    def __init__(self, weight: nn.Parameter, group, reduce_dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = weight  # (out, in), whole
        self.group, self.reduce_dtype = group, reduce_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, CopyWeightToTP.apply(self.weight, self.group, self.reduce_dtype))

    def extra_repr(self) -> str:
        out, inp = self.weight.shape
        return f"in={inp}, out={out} (whole), weight grad: all-reduce over tp{self.group.size}"


class SPReplicatedLinear:
    """A replicated ``nn.Linear``: untouched without SP; with SP a ``ReplicatedLinear``."""

    def apply(self, lin: nn.Module, parent: nn.Module, ctx: TPContext) -> nn.Module | None:
        if not ctx.sp:
            return None
        if lin.bias is not None:
            raise ValueError("tensor parallel linears here have no bias")
        return ReplicatedLinear(lin.weight, ctx.group, ctx.reduce_dtype)


class SPReplicatedNorm:
    """A replicated norm: untouched without SP; with SP a ``SequenceParallelNorm``."""

    def apply(self, norm: nn.Module, parent: nn.Module, ctx: TPContext) -> nn.Module | None:
        return SequenceParallelNorm(norm, ctx.group, ctx.reduce_dtype) if ctx.sp else None


class MLARegion:
    """The MLA mixer: Megatron's f installed as its ``enter_heads`` hook (registered as the child
    ``tp_input`` for ``print(model)``). Raises ValueError when the heads do not split over tp."""

    def apply(self, mla: nn.Module, parent: nn.Module, ctx: TPContext) -> None:
        heads = mla.wkv_b.weight.shape[0] // (mla.nope_dim + mla.v_dim)
        if heads % ctx.group.size:
            raise ValueError(f"MLA heads ({heads}) are not divisible by tp ({ctx.group.size})")
        mla.add_module("tp_input", RegionInput(ctx.group, ctx.sp))
        mla.__dict__["enter_heads"] = mla.tp_input  # shadows the method: the model's hook contract


class MTPShift:
    """On the ``mtp`` ModuleDict: with SP, or when the MTP blocks hold MoE layers (whose tp ranks
    each route 1/tp of the T positions, which T - k need not split into), give the model the
    full-length ``mtp_shift`` hook; the padded tail is masked out of the MoE layers."""

    def apply(self, mtp: nn.Module, parent: nn.Module, ctx: TPContext) -> None:
        if (ctx.sp or moe_layers(mtp)) and getattr(parent, SHIFT_ATTR, None) is None:
            setattr(parent, SHIFT_ATTR, shift_left)


def mla_entries(p: str, mla: MLAttention) -> dict[str, object]:
    """Plan entries (exact names) of the MLA mixer registered at ``p``; see the module docstring."""
    entries: dict[str, object] = {p: MLARegion(), f"{p}.wkv_b": Colwise(), f"{p}.wo": Rowwise(),
                                  f"{p}.wkv_a": SPReplicatedLinear(), f"{p}.kv_norm": SPReplicatedNorm()}
    if hasattr(mla, "wq_a"):
        entries.update({f"{p}.wq_a": SPReplicatedLinear(), f"{p}.q_norm": SPReplicatedNorm(),
                        f"{p}.wq_b": Colwise()})
    else:
        entries[f"{p}.wq"] = Colwise()
    return entries


def mtp_entries(model: nn.Module, plan: dict[str, object], slots: dict) -> dict[str, object]:
    """Plan entries of ``model.mtp`` (none without MTP modules): every ``layers.*.<x>`` pattern of
    ``plan`` (the block norms under SP) as ``mtp.*.block.<x>``; each depth's block slots by the
    same per-layer functions as the decoder blocks, ``slots`` = ``{"attention": mixer_entries,
    "feed_forward": ffn_entries}`` (``fn(name, module) -> entries``; passed in to keep the imports
    one-way); the replicated norms and projection, and the SP shift hook."""
    mtp = getattr(model, "mtp", None)
    if mtp is None:
        return {}
    entries: dict[str, object] = {"mtp": MTPShift(), "mtp.*.hnorm": SPReplicatedNorm(),
                                  "mtp.*.enorm": SPReplicatedNorm(), "mtp.*.norm": SPReplicatedNorm(),
                                  "mtp.*.proj": SPReplicatedLinear()}
    prefix = "layers.*."
    for pattern, style in plan.items():
        if pattern.startswith(prefix):
            entries["mtp.*.block." + pattern[len(prefix):]] = style
    for key, module in mtp.items():
        for slot, fn in slots.items():
            entries.update(fn(f"mtp.{key}.block.{slot}", getattr(module.block, slot)))
    return entries
