"""Tensor parallel (Megatron-LM, Shoeybi et al. 2019) with optional sequence parallel (Korthikanti
et al. 2022), applied from outside to a single-device ``Transformer``.

Each block's two halves become one tensor-parallel region each:

* attention: ``wq`` / ``wk`` / ``wv`` column-parallel (rows of the weight split by heads), ``wo``
  row-parallel (columns split the same way); each rank runs the attention of its own heads;
* MLP: ``w1`` / ``w3`` column-parallel (hidden units split), ``w2`` row-parallel.

The ``nn.Linear`` modules keep their class and names; their weights are replaced in place by this
rank's slice, and the model reads head counts from weight shapes. The f / g operators sit at the
region boundaries as module hooks: without SP ``CopyToTP`` (fwd identity, bwd all-reduce) on the
region's input and ``ReduceFromTP`` (fwd all-reduce, bwd identity) on its output; with SP the
residual stream stays split along the sequence, the input is ``GatherFromSequence`` (fwd all-gather,
bwd reduce-scatter) and the output ``ReduceScatterToSequence`` (fwd reduce-scatter, bwd
all-gather), and norm gains, used on different tokens by each rank, get their gradients summed
over ``tp`` (``CopyToTP`` on the weight).

Vocabulary: the embedding and output head are split by vocabulary rows; V is padded to
``Vp = tp * ceil(V / tp)`` with zero rows. The padded logits are masked to -inf inside
``vocab_parallel_cross_entropy`` (``ndtrain.parallel.tp.vocab_loss``), so they never get probability,
gradient or weight updates, and state dicts (``tp_full_tensor``) drop them.

Grouped-query attention: with ``G % tp == 0`` kv heads are split like q heads. With ``G < tp``
and ``tp % G == 0`` every rank keeps the whole (small) ``wk`` / ``wv`` and uses the one kv head its
q heads belong to (q head block r -> kv head ``r // (tp / G)``); the weight goes through
``CopyToTP`` so each kv head's gradient is the sum over the ranks that used it. Other ratios are
rejected.
"""
from __future__ import annotations

import math
import types

import torch
import torch.nn.functional as F
from torch import nn

from ndtrain.mesh import AxisGroup, Mesh
from ndtrain.optim import SHARD_AXES_ATTR
from ndtrain.parallel.tp.collectives import (
    CopyToTP,
    GatherFromSequence,
    ReduceFromTP,
    ReduceScatterToSequence,
)

TP_SHARD_ATTR = "ndtrain_tp_shard"  # (dim, global size along dim before padding) on split params
SEQ_DIM = 1  # activations are (B, T, C)


def padded_vocab(vocab_size: int, tp: int) -> int:
    """Vocabulary rows after padding to a multiple of ``tp``: ``tp * ceil(V / tp)``."""
    return tp * math.ceil(vocab_size / tp)


def check_tp_heads(n_heads: int, n_kv_heads: int, tp: int) -> None:
    """Raise ValueError (naming the rule) unless heads can be split over ``tp`` ranks."""
    if n_heads % tp:
        raise ValueError(f"n_heads ({n_heads}) is not divisible by tp ({tp})")
    if n_kv_heads % tp and tp % n_kv_heads:
        raise ValueError(f"n_kv_heads ({n_kv_heads}) and tp ({tp}): one must divide the other "
                         "(kv heads are split when G % tp == 0, replicated when tp % G == 0)")


def _shard(p: nn.Parameter, dim: int, group: AxisGroup, pad_to: int | None = None) -> nn.Parameter:
    """This rank's slice of ``p`` along ``dim`` (zero-padded to ``pad_to`` first), tagged."""
    full = p.detach()
    global_size = full.shape[dim]
    if pad_to is not None and pad_to > global_size:
        pad_shape = list(full.shape)
        pad_shape[dim] = pad_to - global_size
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=dim)
    if full.shape[dim] % group.size:
        raise ValueError(f"size {full.shape[dim]} of dim {dim} is not divisible by tp ({group.size})")
    local = nn.Parameter(full.chunk(group.size, dim)[group.rank].clone(), requires_grad=p.requires_grad)
    setattr(local, SHARD_AXES_ATTR, ("tp",))
    setattr(local, TP_SHARD_ATTR, (dim, global_size))
    return local


def _shard_linear(lin: nn.Linear, dim: int, group: AxisGroup, pad_to: int | None = None) -> None:
    """Column-parallel (``dim=0``: output features split) or row-parallel (``dim=1``: inputs split)."""
    lin.weight = _shard(lin.weight, dim, group, pad_to)
    lin.out_features, lin.in_features = lin.weight.shape
    if lin.bias is not None:
        raise ValueError("tensor parallel linears here have no bias (Llama)")


def tp_specs(model: nn.Module) -> dict[str, tuple[int, int]]:
    """``{fqn: (dim, global size)}`` of the parameters ``apply_tp`` split (tied names included);
    recorded on the model, so it survives wrappers that re-create parameters (FSDP)."""
    return getattr(model, "ndtrain_tp_specs", {})


def tp_full_tensor(local: torch.Tensor, spec, group: AxisGroup) -> torch.Tensor:
    """Reassemble a TP-split tensor (a parameter, its gradient or an optimizer moment) on every
    rank of ``group``, without vocabulary padding. ``spec`` is ``(dim, global size)`` (see
    ``tp_specs``), a split parameter, or None / a replicated parameter (returned as it is).
    Collective over ``group`` when the tensor is split."""
    if isinstance(spec, torch.Tensor):
        spec = getattr(spec, TP_SHARD_ATTR, None)
    if spec is None or group.size == 1:
        return local
    dim, size = spec
    full = torch.cat(_all_gather_list(local.contiguous(), group), dim=dim)
    return full.narrow(dim, 0, size)


def tp_local_slice(full: torch.Tensor, spec, group: AxisGroup) -> torch.Tensor:
    """Inverse of ``tp_full_tensor``: this rank's (zero-padded) slice of a full tensor."""
    if spec is None or group.size == 1:
        return full
    dim, size = spec
    per = math.ceil(size / group.size)
    pad = [0, 0] * (full.dim() - 1 - dim) + [0, per * group.size - size]
    return F.pad(full, pad).narrow(dim, group.rank * per, per)


def _all_gather_list(t: torch.Tensor, group: AxisGroup) -> list[torch.Tensor]:
    from ndtrain.parallel.comm import all_gather_into

    out = t.new_empty((group.size,) + tuple(t.shape))
    all_gather_into(out.view(-1), t.reshape(-1), group)
    return list(out.unbind(0))


# --- region boundaries (module hooks) ---
def _region_hooks(module: nn.Module, group: AxisGroup, sp: bool) -> None:
    """f on the first positional input, g on the output (see the module docstring)."""

    def pre(_mod, args):
        x = GatherFromSequence.apply(args[0], group, SEQ_DIM) if sp else CopyToTP.apply(args[0], group)
        return (x,) + tuple(args[1:])

    def post(_mod, _args, out):
        return ReduceScatterToSequence.apply(out, group, SEQ_DIM) if sp else ReduceFromTP.apply(out, group)

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)


def _sum_weight_grad_over(module: nn.Module, group: AxisGroup) -> None:
    """Norm gain used on this rank's tokens only: route it through ``CopyToTP`` so its gradient
    is summed over ``group`` (fwd: identity, bwd: all-reduce)."""
    orig_cls_forward = type(module).forward

    def forward(self, x):
        w = self.weight
        try:
            self.__dict__["weight"] = CopyToTP.apply(w, group)  # shadow the Parameter for one call
            return orig_cls_forward(self, x)
        finally:
            del self.__dict__["weight"]

    module.forward = types.MethodType(forward, module)


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (vocabulary) are split over ``tp``; ids outside this rank's range give
    zeros, and the partial rows are summed (``ReduceFromTP``) or, with SP, reduce-scattered along
    the sequence. Shapes: tokens (B, T) -> (B, T, C), or (B, T/tp, C) with SP."""

    def __init__(self, weight: nn.Parameter, vocab_start: int, group: AxisGroup, sp: bool):
        super().__init__()
        self.weight = weight  # (Vp / tp, C), keeps the name ``tok_embeddings.weight``
        self.vocab_start, self.group, self.sp = vocab_start, group, sp

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])  # (B, T)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)  # (B, T, C)
        h = h.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sp:
            return ReduceScatterToSequence.apply(h, self.group, SEQ_DIM)
        return ReduceFromTP.apply(h, self.group)


def _replicated_kv(lin: nn.Linear, head: int, head_dim: int, group: AxisGroup) -> None:
    """Keep the whole (G*D, C) weight; use only kv head ``head``; gradients summed over ``group``."""
    rows = slice(head * head_dim, (head + 1) * head_dim)
    lin.out_features = head_dim

    def forward(self, x):
        return F.linear(x, CopyToTP.apply(self.weight, group)[rows])  # (B, T, D)

    lin.forward = types.MethodType(forward, lin)


def apply_tp(model: nn.Module, mesh: Mesh, sequence_parallel: bool = False) -> None:
    """Split ``model`` (a ``Transformer`` or a stage of one) over the ``tp`` axis in place.

    Call after ``init_weights`` (slices are cut from the initialised full weights, so every layout
    starts from identical values) and before data parallel. Split parameters carry
    ``ndtrain_shard_axes = ("tp",)`` and ``ndtrain_tp_shard = (dim, global size)``.

    Raises ValueError naming the rule when heads, kv heads, the MLP hidden size or (with SP) the
    stage's missing embedding do not fit ``tp``.
    """
    group = mesh.group("tp")
    if group.size == 1:
        return
    tp, r, sp = group.size, group.rank, sequence_parallel
    for block in model.layers.values():
        att, ffn = block.attention, block.feed_forward
        if not (all(hasattr(att, n) for n in ("wq", "wk", "wv", "wo"))
                and all(hasattr(ffn, n) for n in ("w1", "w2", "w3"))):
            raise NotImplementedError(f"tensor parallel supports Attention + FeedForward blocks, not "
                                      f"{type(att).__name__} + {type(ffn).__name__}")
        d = att.head_dim
        n_heads, n_kv = att.wq.weight.shape[0] // d, att.wk.weight.shape[0] // d
        check_tp_heads(n_heads, n_kv, tp)
        if ffn.w1.weight.shape[0] % tp:
            raise ValueError(f"ffn hidden ({ffn.w1.weight.shape[0]}) is not divisible by tp ({tp})")
        _shard_linear(att.wq, 0, group)
        _shard_linear(att.wo, 1, group)
        for lin in (att.wk, att.wv):
            if n_kv % tp == 0:
                _shard_linear(lin, 0, group)
            else:  # G < tp: q heads of rank r all belong to kv head r // (tp / G)
                _replicated_kv(lin, r // (tp // n_kv), d, group)
        _shard_linear(ffn.w1, 0, group)
        _shard_linear(ffn.w3, 0, group)
        _shard_linear(ffn.w2, 1, group)
        _region_hooks(att, group, sp)
        _region_hooks(ffn, group, sp)
        if sp:
            _sum_weight_grad_over(block.attention_norm, group)
            _sum_weight_grad_over(block.ffn_norm, group)
    vocab = model.cfg.vocab_size
    vp = padded_vocab(vocab, tp)
    tied = (model.tok_embeddings is not None and model.output is not None
            and model.output.weight is model.tok_embeddings.weight)
    emb_weight = None
    if model.tok_embeddings is not None:
        emb_weight = _shard(model.tok_embeddings.weight, 0, group, pad_to=vp)
        model.tok_embeddings = VocabParallelEmbedding(emb_weight, r * (vp // tp), group, sp)
    # A pipeline stage without the embedding / head takes / returns the residual stream as it is
    # under SP, split along the sequence: stages exchange (B, T/tp, C) shards rank by rank (tp times
    # less p2p traffic; a gather at the boundary would sum the replicated incoming gradient tp times).
    if model.output is not None:
        if tied:
            model.output.weight = emb_weight
            model.output.out_features = emb_weight.shape[0]
        else:
            _shard_linear(model.output, 0, group, pad_to=vp)
        model.output.register_forward_pre_hook(
            lambda _m, args: ((GatherFromSequence.apply(args[0], group, SEQ_DIM) if sp
                               else CopyToTP.apply(args[0], group)),))
    if sp:
        if model.norm is not None:
            _sum_weight_grad_over(model.norm, group)
        model.register_forward_pre_hook(_full_positions, with_kwargs=True)
    model.ndtrain_tp_specs = {n: getattr(p, TP_SHARD_ATTR) for n, p in
                              model.named_parameters(remove_duplicate=False) if hasattr(p, TP_SHARD_ATTR)}


def _full_positions(model, args, kwargs):
    """With SP the residual stream is (B, T/tp, C), but RoPE needs the positions of the whole
    sequence the attention sees: default them to ``arange(T)`` from the tokens."""
    if len(args) > 1 or kwargs.get("positions") is not None or kwargs.get("kv_cache") is not None:
        return None
    kwargs = dict(kwargs, positions=torch.arange(args[0].shape[1], device=args[0].device))
    return args, kwargs
