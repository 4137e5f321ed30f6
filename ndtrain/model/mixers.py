"""The token-mixer interface: what fills a block's ``attention`` slot, chosen per layer by
``model.layer_pattern`` (``ndtrain.mixer_spec``; letters A L M G S D).

Every mixer is an ordinary single-device ``nn.Module`` with the attention signature
``forward(x (B, T, C), cos, sin, kv_cache=None) -> (B, T, C)``, so ZeRO, DDP, activation
checkpointing and autocast apply unchanged. Softmax and window layers keep keys / values in the
cache's ``update``; the linear family (linear, mamba2, gated_deltanet) keeps a fixed-size
recurrent state in ``kv_cache.states[layer_id]`` (``ndtrain.inference.generate.KVCache``), and a cached
forward of one token takes the ``recurrent`` op, of several the ``chunk`` op from that state.

``LINEAR_IMPL`` selects the sequence form of the linear family: "chunk" (default) or "naive" (the
token-by-token reference from the paper, the slow twin the tests pin the model to).

Shared pieces (short causal convolution, gated RMSNorm, state lookup) live in ``mixer_common``;
linear attention (Katharopoulos et al. 2020) in ``linear_attention``.
"""
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
    """The token mixer ``kind`` for block ``layer_id``; "attention" is ``Attention`` / ``MLAttention``
    exactly as before (so a model without a pattern is bitwise unchanged)."""
    if kind == "attention":
        return (MLAttention(cfg, layer_id) if cfg.attention == "mla"
                else Attention(cfg.dim, cfg.n_heads, cfg.kv_heads, layer_id, cfg.attn_head_dim, cfg.qk_norm,
                               cfg.norm_eps, cfg.attn_output_gate))
    builders = {"linear": LinearAttention, "mamba2": Mamba2, "gated_deltanet": GatedDeltaNet,
                "sliding_window": SlidingWindowAttention, "dsa": SparseAttention}
    return builders[kind](cfg, layer_id)
