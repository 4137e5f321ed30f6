"""Causal GQA attention over packed variable-length sequences: ``naive_attention`` and the
Triton FlashAttention-2 ``flash_attention`` (Dao 2023)."""
from ndtrain.ops.flash_attention.naive import naive_attention

__all__ = ["naive_attention"]
