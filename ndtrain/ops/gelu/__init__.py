"""GeLU, tanh approximation (Hendrycks & Gimpel 2016): ``naive_gelu`` and the Triton ``fused_gelu``."""
from ndtrain.ops.gelu.naive import naive_gelu

__all__ = ["naive_gelu"]
