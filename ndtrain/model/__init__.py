"""Single-device Llama-3-style model: build on meta, init deterministically, compose for parallelism."""
from ndtrain.model.attention import Attention, causal_attention
from ndtrain.model.init import count_params, init_weights
from ndtrain.model.mlp import FeedForward
from ndtrain.model.norm import RMSNorm
from ndtrain.model.rope import apply_rope, rope_inv_freq, rope_tables
from ndtrain.model.transformer import Transformer, TransformerBlock, build_model

__all__ = [
           "Attention",
           "FeedForward",
           "RMSNorm",
           "Transformer",
           "TransformerBlock",
           "apply_rope",
           "build_model",
           "causal_attention",
           "count_params",
           "init_weights",
           "rope_inv_freq",
           "rope_tables",
]
