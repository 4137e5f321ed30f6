"""RMSNorm (Zhang & Sennrich 2019): ``naive_rmsnorm`` and the Triton ``fused_rmsnorm``."""
from ndtrain.ops.rmsnorm.naive import naive_rmsnorm

__all__ = ["naive_rmsnorm"]
