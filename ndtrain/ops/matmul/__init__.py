"""Matmul with a fused epilogue: ``naive_matmul`` and the Triton tiled ``fused_matmul``."""
from ndtrain.ops.matmul.naive import ACTIVATIONS, naive_matmul

__all__ = ["ACTIVATIONS", "naive_matmul"]
