"""LoRA adapters (Hu et al. 2021; ``ndtrain.model.lora``) on the linears of a parallelized model,
split to match their base layer under tensor parallelism (Megatron-LM, Shoeybi et al. 2019):

  column-parallel base (W rows split, x whole):  A (r, in) whole, B (out/tp, r) split on out;
      y_local = W_local x + s * B_local (A x). A's gradient is a sum of every rank's part:
      A passes through ``CopyWeightToTP`` (fwd: identity, bwd: all-reduce over tp).
  row-parallel base (W columns split, x split on in):  A (r, in/tp) split on in, B (out, r) whole;
      h = A_local x_local is a partial sum, completed by ``ReduceFromTP`` (fwd: all-reduce over tp,
      r numbers per token), then y += s * B h. Under sequence parallel h is reduce-scattered along
      T instead (as the base's output is), and B, used on this rank's tokens only, passes through
      ``CopyWeightToTP``.

The slices carry the tensor-parallel tags (``ndtrain_tp_shard``), so checkpoints gather them whole
under their single-process names and the gradient norm sums them over tp. Applied after tp / cp and
before activation checkpointing (whose recompute re-runs the hooks) and data parallel (which then
sees the adapters as the only trainable parameters). ``lower_frozen`` stores the frozen base
matrices in the autocast dtype (bf16 / fp16 runs) once data parallel is in place.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ndtrain.mesh import Mesh
from ndtrain.model import lora
from ndtrain.optim import SHARD_AXES_ATTR
from ndtrain.parallel.tp.collectives import CopyWeightToTP, ReduceFromTP, ReduceScatterToSequence
from ndtrain.parallel.tp.layers import TP_SHARD_ATTR, ColumnParallelLinear, RowParallelLinear, _LinearShard

if TYPE_CHECKING:
    from ndtrain.config import Config


def _adaptable(mod: nn.Module) -> bool:
    if type(mod) is ColumnParallelLinear:
        return not mod.enter_region  # the output head gathers its own input: not an adapter target
    return type(mod) is RowParallelLinear or lora.is_plain_linear(mod)


def apply_lora_parallel(model: nn.Module, mesh: Mesh, cfg: Config, reduce_dtype: torch.dtype | None) -> list[str]:
    """LoRA on ``model`` (a parallelized model or pipeline stage) in place: adapters on the
    ``finetune.lora_targets`` linears, each this rank's slice of the layout-independent whole
    (``lora.init_adapter``), every other parameter frozen. Returns the adapted module names.
    Raises ValueError for a target that is not a plain, column- or row-parallel linear (a
    replicated kv projection when n_kv_heads < tp, the output head) or a pattern matching nothing."""
    f, seed = cfg.finetune, cfg.training.seed
    names = lora.find_targets(model, lora.parse_targets(f.lora_targets), _adaptable)
    scale = f.lora_alpha / f.lora_rank
    for name in names:
        mod = model.get_submodule(name)
        dev, dt = mod.weight.device, mod.weight.dtype
        if type(mod) is ColumnParallelLinear:
            g = mod.group
            a, b = lora.init_adapter(name, mod.in_features, mod.out_features * g.size, f.lora_rank, seed, dt)
            b = b.chunk(g.size, 0)[g.rank].clone()
            delta = functools.partial(_column_delta, reduce_dtype=reduce_dtype)
            lora.attach(mod, a.to(dev), b.to(dev), scale, f.lora_dropout, delta)
            _tag(mod.lora_B, 0, mod.out_features * g.size)
        elif type(mod) is RowParallelLinear:
            g = mod.group
            a, b = lora.init_adapter(name, mod.in_features * g.size, mod.out_features, f.lora_rank, seed, dt)
            a = a.chunk(g.size, 1)[g.rank].clone()
            delta = functools.partial(_row_delta, reduce_dtype=reduce_dtype)
            lora.attach(mod, a.to(dev), b.to(dev), scale, f.lora_dropout, delta)
            _tag(mod.lora_A, 1, mod.in_features * g.size)
        else:
            a, b = lora.init_adapter(name, mod.in_features, mod.out_features, f.lora_rank, seed, dt)
            lora.attach(mod, a.to(dev), b.to(dev), scale, f.lora_dropout)
    lora.freeze_base(model)
    if hasattr(model, "ndtrain_tp_specs"):  # the checkpoint adapter's record of every tp split
        model.ndtrain_tp_specs.update({n: getattr(p, TP_SHARD_ATTR) for n, p in model.named_parameters()
                                       if lora.is_adapter(n) and hasattr(p, TP_SHARD_ATTR)})
    return names


def _tag(p: nn.Parameter, dim: int, size: int) -> None:
    setattr(p, SHARD_AXES_ATTR, ("tp",))
    setattr(p, TP_SHARD_ATTR, (dim, size))


def _column_delta(mod: ColumnParallelLinear, x: torch.Tensor, reduce_dtype) -> torch.Tensor:
    """x (..., in) whole -> (..., out/tp): s * B_local (A x), A's gradient summed over tp."""
    x = F.dropout(x, mod.lora_dropout, mod.training) if mod.lora_dropout else x
    a = CopyWeightToTP.apply(mod.lora_A, mod.group, reduce_dtype)
    return F.linear(F.linear(x, a), mod.lora_B) * mod.lora_scale  # (..., r) -> (..., out/tp)


def _row_delta(mod: RowParallelLinear, x: torch.Tensor, reduce_dtype) -> torch.Tensor:
    """x (B, T, in/tp) -> (B, T, out), or (B, T/tp, out) under SP: s * B (sum over tp of A_local x_local)."""
    x = F.dropout(x, mod.lora_dropout, mod.training) if mod.lora_dropout else x
    h = F.linear(x, mod.lora_A)  # (B, T, r), this rank's partial sum
    if mod.sp:
        h = ReduceScatterToSequence.apply(h, mod.group, mod.dim)  # (B, T/tp, r)
        b = CopyWeightToTP.apply(mod.lora_B, mod.group, reduce_dtype)
    else:
        h, b = ReduceFromTP.apply(h, mod.group), mod.lora_B  # (B, T, r) whole on every rank
    return F.linear(h, b) * mod.lora_scale


@torch.no_grad()
def lower_frozen(model: nn.Module, dtype: torch.dtype | None) -> int:
    """Store each frozen linear weight (plain or tensor-parallel) in ``dtype`` (the bf16 / fp16
    autocast dtype: the matmul reads it in that dtype anyway), halving the base's bytes; embeddings
    and norms keep theirs (they are not autocast). Returns how many weights were cast (0 if
    ``dtype`` is None)."""
    if dtype is None:
        return 0
    n = 0
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if (isinstance(mod, (nn.Linear, _LinearShard)) and isinstance(w, nn.Parameter)
                and not w.requires_grad and w.dtype != dtype):
            w.data = w.data.to(dtype)
            n += 1
    return n
