"""Cross-entropy of a linear output head: ``naive_linear_cross_entropy`` (full logits) and the
chunked Triton ``fused_linear_cross_entropy`` (never the full logits; vocab-parallel variant)."""
from ndtrain.ops.linear_cross_entropy.naive import naive_linear_cross_entropy

__all__ = ["naive_linear_cross_entropy"]
