"""Tensor-parallel plan entries of every token mixer (``model.layer_pattern``), per layer.

Every mixer splits by heads, like softmax attention in Megatron-LM (Shoeybi et al. 2019): the
projections that make per-head quantities are column-parallel, the output projection row-parallel,
and each rank runs its own heads. The recurrent state of the linear family is per head (linear
attention and Gated DeltaNet: one (K, V) state per head; Mamba-2: one (N, P) state per head), so
the chunked / recurrent ops need no communication: each block keeps the one f / g pair of its
region (Megatron's identity / all-reduce, or with sequence parallel all-gather / reduce-scatter).

Per mixer (slots not listed are replicated and untouched):

* ``Attention`` / ``SlidingWindowAttention``: ``wq`` column, ``wk`` / ``wv`` by kv heads
  (``plan.KVHeads``), ``wo`` row; the output gate ``wg`` column; QK-norm gains (one per head dim,
  shared by the heads) replicated with their gradient summed over tp.
* ``SparseAttention`` (DSA): as attention; the lightning indexer (``wq_index``, ``wk_index``,
  ``w_index``) is replicated, so every rank selects the same top-k keys with no communication. Its
  KL target sums the main attention's probabilities over all heads: one all-reduce of the
  (B, T, k) head sum per layer (``reduce_heads``); every rank then has the same loss, and the
  replicated indexer the same gradient, as on one device.
* ``LinearAttention``: ``wq wk wv`` column, ``wo`` row.
* ``GatedDeltaNet`` (Yang et al. 2024; layout of Qwen3-Next): ``in_proj_qkvz`` / ``in_proj_ba``
  are grouped per key head in ``transformers``' order, so a contiguous row split is a split by
  key heads (with their r = H_v / H_k value heads); the short convolution's [q | k | v] channels
  are split block by block; ``A_log`` / ``dt_bias`` by value head; the output norm is per head
  with one shared gain (replicated, gradient summed); ``out_proj`` row.
* ``Mamba2`` (Dao & Gu 2024): ``in_proj`` rows [z | x | B | C | dt] and the convolution's
  [x | B | C] channels split block by block, ``A_log`` / ``dt_bias`` / ``D`` by head, the gated
  norm's gain by channel. Heads of one B / C group share them, so the groups are split with the
  heads (``mamba_groups % tp == 0``, as ``mamba_ssm`` requires): each rank holds whole groups, the
  group-wise gated norm stays local and exact. ``out_proj`` row.

Parameter names do not change; split parameters carry ``ndtrain_tp_shard`` = (dim, global size) or,
for the block-wise splits of fused weights, (dim, global size, blocks), which
``tp_full_tensor`` / ``tp_local_slice`` use to rebuild the global tensor for checkpoints, HF
export and the gathered model. After the plan, ``localize_heads`` sets the per-rank head counts
the mixers' forward reads (the model code stays single-device).
"""
from __future__ import annotations

from torch import nn

from ndtrain.model.attention import Attention
from ndtrain.model.dsa import SparseAttention
from ndtrain.model.gated_deltanet import GatedDeltaNet
from ndtrain.model.linear_attention import LinearAttention
from ndtrain.model.mamba2 import Mamba2
from ndtrain.model.mla import MLAttention
from ndtrain.parallel.comm import all_reduce
from ndtrain.parallel.tp.layers import SequenceParallelNorm
from ndtrain.parallel.tp.mla_plan import mla_entries
from ndtrain.parallel.tp.plan import Colwise, KVHeads, Region, Rowwise, TPContext


class SharedGain:
    """A norm applied per head with one gain shared by the heads (QK-norm, Gated DeltaNet's output
    norm): the gain stays whole on every rank but sees only this rank's heads, so its gradient is
    summed over tp (``SequenceParallelNorm``, the same wrapper SP uses for the block norms)."""

    def apply(self, norm: nn.Module, parent: nn.Module, ctx: TPContext) -> nn.Module:
        return SequenceParallelNorm(norm, ctx.group, ctx.reduce_dtype)


class SplitGain:
    """A norm gain over a head-split width (Mamba-2's gated norm over the inner width): split by
    channel like the heads; the norm itself is per B / C group, and every group lives on one rank."""

    def apply(self, norm: nn.Module, parent: nn.Module, ctx: TPContext) -> None:
        norm.weight = ctx.shard(norm.weight, 0)


class BlockColwise:
    """A fused ``nn.Linear`` whose output rows are blocks of per-head quantities (Mamba-2's
    [z | x | B | C | dt]): each block split over tp, this rank keeping its piece of every block
    (``ColumnParallelLinear`` on the concatenated pieces). ``blocks(parent)`` gives the block sizes."""

    def __init__(self, blocks):
        self.blocks = blocks

    def apply(self, lin: nn.Module, parent: nn.Module, ctx: TPContext) -> nn.Module:
        from ndtrain.parallel.tp.layers import ColumnParallelLinear

        if lin.bias is not None:
            raise ValueError("tensor parallel linears here have no bias")
        w = ctx.shard(lin.weight, 0, segments=self.blocks(parent))
        return ColumnParallelLinear(w, ctx.group, lin.weight.shape[0], ctx.sp)


class BlockConv:
    """A depthwise short convolution over blocks of per-head channels ([q | k | v] of Gated
    DeltaNet, [x | B | C] of Mamba-2): weight (Ch, 1, W) and bias split block by block, in place.
    Depthwise: each channel is convolved alone, so the local channels need nothing from other ranks."""

    def __init__(self, blocks):
        self.blocks = blocks

    def apply(self, conv: nn.Module, parent: nn.Module, ctx: TPContext) -> None:
        blocks = self.blocks(parent)
        conv.weight = ctx.shard(conv.weight, 0, segments=blocks)
        if conv.bias is not None:
            conv.bias = ctx.shard(conv.bias, 0, segments=blocks)
        conv.in_channels = conv.out_channels = conv.groups = conv.weight.shape[0]


class HeadParams:
    """The mixer's own per-head vectors (``A_log``, ``dt_bias``, Mamba-2's ``D``) split by head,
    and the region's f (``plan.Region``) on its input."""

    def __init__(self, names: tuple[str, ...] = ()):
        self.names = names

    def apply(self, mixer: nn.Module, parent: nn.Module, ctx: TPContext) -> None:
        Region().apply(mixer, parent, ctx)
        for n in self.names:
            setattr(mixer, n, ctx.shard(getattr(mixer, n), 0))


class SparseRegion:
    """DSA: the region's f, and the indexer KL target's head sum completed over tp (an all-reduce
    of the detached (B, T, k) sum; no gradient flows through it)."""

    def apply(self, mixer: nn.Module, parent: nn.Module, ctx: TPContext) -> None:
        Region().apply(mixer, parent, ctx)
        group = ctx.group

        def reduce_heads(p):
            p = p.contiguous().clone()
            all_reduce(p, group)
            return p

        mixer.reduce_heads = reduce_heads


def _attention(p: str, region) -> dict[str, object]:
    return {p: region, f"{p}.wq": Colwise(), f"{p}.wk": KVHeads(), f"{p}.wv": KVHeads(), f"{p}.wo": Rowwise(),
            f"{p}.wg": Colwise(), f"{p}.q_norm": SharedGain(), f"{p}.k_norm": SharedGain()}


def _gdn_conv(m: GatedDeltaNet) -> tuple[int, ...]:
    return (m.key_dim, m.key_dim, m.value_dim)


def _mamba_proj(m: Mamba2) -> tuple[int, ...]:
    gn = m.n_groups * m.n_state
    return (m.d_inner, m.d_inner, gn, gn, m.n_heads)


def _mamba_conv(m: Mamba2) -> tuple[int, ...]:
    gn = m.n_groups * m.n_state
    return (m.d_inner, gn, gn)


def mixer_entries(name: str, mixer: nn.Module) -> dict[str, object]:
    """Plan entries (exact module names) of the token mixer ``mixer`` registered at ``name``
    (``layers.<i>.attention``). Raises NotImplementedError for a mixer without a plan."""
    p = name
    if isinstance(mixer, MLAttention):  # DeepSeek MLA: ndtrain.parallel.tp.mla_plan
        return mla_entries(p, mixer)
    if isinstance(mixer, SparseAttention):
        return _attention(p, SparseRegion())
    if isinstance(mixer, Attention) and hasattr(mixer, "wq"):  # softmax, sliding window
        return _attention(p, Region())
    if isinstance(mixer, LinearAttention):
        return {p: Region(), f"{p}.wq": Colwise(), f"{p}.wk": Colwise(), f"{p}.wv": Colwise(), f"{p}.wo": Rowwise()}
    if isinstance(mixer, GatedDeltaNet):
        return {p: HeadParams(("dt_bias", "A_log")), f"{p}.in_proj_qkvz": Colwise(), f"{p}.in_proj_ba": Colwise(),
                f"{p}.conv1d": BlockConv(_gdn_conv), f"{p}.norm": SharedGain(), f"{p}.out_proj": Rowwise()}
    if isinstance(mixer, Mamba2):
        return {p: HeadParams(("dt_bias", "A_log", "D")), f"{p}.in_proj": BlockColwise(_mamba_proj),
                f"{p}.conv1d": BlockConv(_mamba_conv), f"{p}.norm": SplitGain(), f"{p}.out_proj": Rowwise()}
    raise NotImplementedError(f"tensor parallel has no plan for the token mixer {type(mixer).__name__}")


def check_mixer(mixer: nn.Module, tp: int) -> None:
    """Raise ValueError (naming the rule) when a linear-family mixer's heads or groups do not split
    over ``tp``; the softmax-attention family is checked by ``rules.check_heads``."""
    if isinstance(mixer, GatedDeltaNet) and mixer.num_k_heads % tp:
        raise ValueError(f"gated_deltanet key heads (linear_heads {mixer.num_k_heads}) are not divisible "
                         f"by tp ({tp})")
    if isinstance(mixer, Mamba2) and mixer.n_groups % tp:
        raise ValueError(f"mamba2 B / C groups (mamba_groups {mixer.n_groups}) are not divisible by tp ({tp}): "
                         "heads of a group share B, C and the gated-norm group, so groups split with the heads")


def localize_heads(model: nn.Module, tp: int) -> None:
    """Set the per-rank head / width counts the mixers' forward reads (``mixer_entries`` split their
    weights by these), once, after the plan."""
    for block in model.layers.values():
        m = block.attention
        if isinstance(m, GatedDeltaNet):
            m.num_k_heads, m.num_v_heads = m.num_k_heads // tp, m.num_v_heads // tp
            m.key_dim, m.value_dim = m.key_dim // tp, m.value_dim // tp
        elif isinstance(m, Mamba2):
            m.d_inner, m.n_heads, m.n_groups = m.d_inner // tp, m.n_heads // tp, m.n_groups // tp
            m.norm.groups = m.n_groups
