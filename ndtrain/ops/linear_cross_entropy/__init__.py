"""Cross-entropy of a linear output head: ``naive_linear_cross_entropy`` (full logits), the chunked
PyTorch ``chunk_linear_cross_entropy`` and the chunked Triton ``fused_linear_cross_entropy`` (both
never hold the full logits; vocab-parallel variants)."""
from ndtrain.ops.linear_cross_entropy.chunk import chunk_linear_cross_entropy
from ndtrain.ops.linear_cross_entropy.naive import naive_linear_cross_entropy

__all__ = ["chunk_linear_cross_entropy", "naive_linear_cross_entropy"]
