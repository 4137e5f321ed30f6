"""The token-mixer interface: what fills a block's ``attention`` slot, per ``model.layer_pattern``
(``ndtrain.mixer_spec``; letters A L M G S D; docs/attention_alternatives.md).

Every mixer is a single-device module with ``forward(x (B, T, C), cos, sin, kv_cache=None,
documents=None) -> (B, T, C)``; ``documents`` (B, T) packed ids keep attention, state and
convolution inside each document (``model.documents``). The linear family keeps a fixed-size state in ``kv_cache.states[layer_id]``; a cached
one-token forward takes the ``recurrent`` op, several tokens the ``chunk`` op. ``LINEAR_IMPL``:
"chunk" or "naive" (the slow twin)."""
from __future__ import annotations

from torch import nn

from ndtrain.mixer_spec import layer_mixers
from ndtrain.model.attention import Attention
from ndtrain.model.dsa import SparseAttention
from ndtrain.model.gated_deltanet import GatedDeltaNet
from ndtrain.model.linear_attention import LinearAttention
from ndtrain.model.mamba2 import Mamba2
from ndtrain.model.mixer_common import LINEAR_IMPL
from ndtrain.model.mla import MLAttention
from ndtrain.model.sliding_window import SlidingWindowAttention

__all__ = ["LINEAR_IMPL", "build_mixer", "mixer_kinds"]


def mixer_kinds(cfg) -> list[str]:
    """Mixer name per layer of ``cfg`` (a ``ModelConfig``)."""
    return layer_mixers(cfg.layer_pattern, cfg.n_layers)


def build_mixer(cfg, layer_id: str, kind: str) -> nn.Module:
    """The mixer ``kind`` for block ``layer_id``; "attention" is ``Attention`` / ``MLAttention`` exactly."""
    if kind == "attention":
        return (MLAttention(cfg, layer_id) if cfg.attention == "mla"
                else Attention(cfg.dim, cfg.n_heads, cfg.kv_heads, layer_id, cfg.attn_head_dim, cfg.qk_norm,
                               cfg.norm_eps, cfg.attn_output_gate))
    builders = {"linear": LinearAttention, "mamba2": Mamba2, "gated_deltanet": GatedDeltaNet,
                "sliding_window": SlidingWindowAttention, "dsa": SparseAttention}
    return builders[kind](cfg, layer_id)
