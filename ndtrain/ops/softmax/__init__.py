"""Row softmax over the last dim: ``naive_softmax`` and the Triton ``fused_softmax``."""
from ndtrain.ops.softmax.naive import naive_softmax

__all__ = ["naive_softmax"]
