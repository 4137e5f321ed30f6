"""SwiGLU gate ``silu(a) * b`` (Shazeer 2020): ``naive_swiglu`` and the Triton ``fused_swiglu``."""
from ndtrain.ops.swiglu.naive import naive_swiglu

__all__ = ["naive_swiglu"]
