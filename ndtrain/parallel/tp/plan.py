"""The tensor-parallel plan: one table ``{module-name pattern: style}`` for every model ndtrain
builds (dense, every token mixer, MoE, MLA, MTP), in the manner of torchtitan's
``parallelize_module`` plans, and the loop that applies it.

Pattern: a module name, component by component. ``*`` is any one component; ``{block}`` is a
decoder block, ``layers.<i>`` or an MTP depth's ``mtp.<k>.block``; ``name[kind]`` also requires
the module there (before any row ran) to be of that kind (``KINDS``), which is how one table tells
a Mamba-2 ``in_proj`` from a Gated DeltaNet one. The styles (``ndtrain.parallel.tp.styles``) say
what happens to a matched module; rows naming modules a model lacks (an output gate, a pipeline
stage without the head) match nothing. Modules no row names stay whole and untouched on every
rank (DSA's indexer; MLA's latent path and MTP's projection without SP).
"""
from __future__ import annotations

import re

from torch import nn

from ndtrain.model.attention import Attention
from ndtrain.model.dsa import SparseAttention
from ndtrain.model.gated_deltanet import GatedDeltaNet
from ndtrain.model.linear_attention import LinearAttention
from ndtrain.model.mamba2 import Mamba2
from ndtrain.model.mla import MLAttention
from ndtrain.model.mlp import FeedForward
from ndtrain.model.moe import MoE
from ndtrain.model.sliding_window import SlidingWindowAttention
from ndtrain.parallel.tp.styles import (
    BlockColwise,
    BlockConv,
    Colwise,
    Experts,
    HeadParams,
    KVHeads,
    MLARegion,
    MoELayer,
    MTPShift,
    Region,
    Rowwise,
    SharedGain,
    SparseRegion,
    SplitGain,
    SPNorm,
    SPReplicatedLinear,
    TokenRegion,
    TokenReplicated,
    TokenRowwise,
    TPContext,
    VocabEmbedding,
    VocabHead,
    gdn_conv_blocks,
    mamba_conv_blocks,
    mamba_proj_blocks,
)

# the module classes a ``[kind]`` stands for (exact types: a subclass needs its own rows)
KINDS: dict[str, tuple[type, ...]] = {
    "softmax": (Attention, SlidingWindowAttention, SparseAttention),  # full, windowed, DSA
    "attention": (Attention, SlidingWindowAttention),
    "dsa": (SparseAttention,),
    "linear": (LinearAttention,),
    "gated_deltanet": (GatedDeltaNet,),
    "mamba2": (Mamba2,),
    "mla": (MLAttention,),
    "dense": (FeedForward,),
    "moe": (MoE,),
}
MIXER_KINDS = ("softmax", "linear", "gated_deltanet", "mamba2", "mla")  # what a block's attention may be
FFN_KINDS = ("dense", "moe")

GDN = ("dt_bias", "A_log"), ("num_k_heads", "num_v_heads", "key_dim", "value_dim")  # split / divided
MAMBA = ("dt_bias", "A_log", "D"), ("d_inner", "n_heads", "n_groups")

TP_PLAN: dict[str, object] = {
    # ends of the model and the residual stream's norms (SP: split along T, gains summed over tp)
    "tok_embeddings": VocabEmbedding(),  # rows by vocabulary, padded to tp * ceil(V / tp)
    "output": VocabHead(),  # columns of the padded vocabulary; logits stay split
    "norm": SPNorm(),
    "{block}.attention_norm": SPNorm(),
    "{block}.ffn_norm": SPNorm(),
    # softmax attention, sliding window, DSA (Megatron-LM): per-head projections split
    "{block}.attention[attention]": Region(),
    "{block}.attention[dsa]": SparseRegion(),  # + the indexer target's head sum over tp
    "{block}.attention[softmax].wq": Colwise(),
    "{block}.attention[softmax].wk": KVHeads(),  # by kv head, or replicated when G < tp
    "{block}.attention[softmax].wv": KVHeads(),
    "{block}.attention[softmax].wo": Rowwise(),
    "{block}.attention[softmax].wg": Colwise(),  # output gate (Qwen3-Next)
    "{block}.attention[softmax].q_norm": SharedGain(),  # QK-norm: one gain for all heads
    "{block}.attention[softmax].k_norm": SharedGain(),
    # linear attention (Katharopoulos 2020)
    "{block}.attention[linear]": Region(),
    "{block}.attention[linear].wq": Colwise(),
    "{block}.attention[linear].wk": Colwise(),
    "{block}.attention[linear].wv": Colwise(),
    "{block}.attention[linear].wo": Rowwise(),
    # Gated DeltaNet (Yang 2024; fused projections grouped per key head, as in transformers)
    "{block}.attention[gated_deltanet]": HeadParams(*GDN),
    "{block}.attention[gated_deltanet].in_proj_qkvz": Colwise(),
    "{block}.attention[gated_deltanet].in_proj_ba": Colwise(),
    "{block}.attention[gated_deltanet].conv1d": BlockConv(gdn_conv_blocks),
    "{block}.attention[gated_deltanet].norm": SharedGain(),
    "{block}.attention[gated_deltanet].out_proj": Rowwise(),
    # Mamba-2 (Dao & Gu 2024; whole B / C groups per rank)
    "{block}.attention[mamba2]": HeadParams(*MAMBA),
    "{block}.attention[mamba2].in_proj": BlockColwise(mamba_proj_blocks),
    "{block}.attention[mamba2].conv1d": BlockConv(mamba_conv_blocks),
    "{block}.attention[mamba2].norm": SplitGain(),
    "{block}.attention[mamba2].out_proj": Rowwise(),
    # DeepSeek MLA: latent path replicated, per-head up-projections split
    "{block}.attention[mla]": MLARegion(),
    "{block}.attention[mla].wq_a": SPReplicatedLinear(),
    "{block}.attention[mla].q_norm": SPNorm(),
    "{block}.attention[mla].wq_b": Colwise(),
    "{block}.attention[mla].wq": Colwise(),  # full-rank queries (no q_lora_rank)
    "{block}.attention[mla].wkv_a": SPReplicatedLinear(),
    "{block}.attention[mla].kv_norm": SPNorm(),
    "{block}.attention[mla].wkv_b": Colwise(),
    "{block}.attention[mla].wo": Rowwise(),
    # dense SwiGLU feed-forward
    "{block}.feed_forward[dense]": Region(),
    "{block}.feed_forward[dense].w1": Colwise(),
    "{block}.feed_forward[dense].w3": Colwise(),
    "{block}.feed_forward[dense].w2": Rowwise(),
    # MoE: tp ranks route different tokens (ndtrain.parallel.tp.moe_layers)
    "{block}.feed_forward[moe]": MoELayer(),
    "{block}.feed_forward[moe].router": TokenReplicated(fp32=True),
    "{block}.feed_forward[moe].experts": Experts(),  # whole, or hidden split (parallel.expert_tp)
    "{block}.feed_forward[moe].shared": TokenRegion(),
    "{block}.feed_forward[moe].shared.w1": Colwise(),
    "{block}.feed_forward[moe].shared.w3": Colwise(),
    "{block}.feed_forward[moe].shared.w2": TokenRowwise(),
    "{block}.feed_forward[moe].shared_gate": TokenReplicated(),
    # MTP depths (their blocks are the {block} rows above)
    "mtp": MTPShift(),
    "mtp.*.hnorm": SPNorm(),
    "mtp.*.enorm": SPNorm(),
    "mtp.*.norm": SPNorm(),
    "mtp.*.proj": SPReplicatedLinear(),  # (C, 2C), kept whole: no collective
}

_BLOCK = r"(?:layers\.[^.]+|mtp\.[^.]+\.block)"


def _compile(pattern: str) -> tuple[re.Pattern, list[tuple[str, str]]]:
    """``pattern`` -> (regex over module names, [(group name, kind)] of its ``[kind]`` guards)."""
    rx, guards = "", []
    for i, part in enumerate(pattern.split(".")):
        name, _, kind = part.partition("[")
        piece = _BLOCK if name == "{block}" else "[^.]+" if name == "*" else re.escape(name)
        rx = piece if i == 0 else rx + r"\." + piece
        if kind:
            kind = kind.rstrip("]")
            if kind not in KINDS:
                raise ValueError(f"tensor-parallel plan pattern {pattern!r}: unknown kind {kind!r}")
            guards.append((f"g{len(guards)}", kind))
            rx = f"(?P<{guards[-1][0]}>{rx})"
    return re.compile(f"^{rx}$"), guards


def apply_plan(model: nn.Module, plan: dict[str, object], ctx: TPContext) -> list[str]:
    """Apply ``plan`` to ``model`` in place, in module registration order (a tied embedding is cut
    before its head, a module before its children), then the styles' deferred steps. Returns the
    names of the modules a style was applied to. Raises ValueError for a module two rows match."""
    compiled = [(*_compile(pat), style) for pat, style in plan.items()]
    before = dict(model.named_modules())  # snapshot: styles replace modules; guards read the originals
    applied = []
    for name, mod in before.items():
        styles = []
        for rx, guards, style in compiled:
            m = rx.match(name)
            if m and all(type(before[m.group(g)]) in KINDS[kind] for g, kind in guards):
                styles.append(style)
        if not styles:
            continue
        if len(styles) > 1:
            raise ValueError(f"module {name} matches more than one tensor-parallel plan entry")
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        new = styles[0].apply(mod, parent, ctx)
        if new is not None:
            setattr(parent, attr, new)
        applied.append(name)
    for fn in ctx.deferred:
        fn()
    return applied


def slot_kind(module: nn.Module | None, kinds: tuple[str, ...]) -> str | None:
    """The first of ``kinds`` whose classes include ``type(module)`` exactly (None if none)."""
    return next((k for k in kinds if type(module) in KINDS[k]), None)
