"""Which implementation of the hot ops a run uses (``training.kernels``; docs/kernels.md): ``eager``
(PyTorch, the reference), ``triton`` (``fused_rmsnorm``, ``fused_swiglu``, FlashAttention-2; needs
CUDA or ``TRITON_INTERPRET=1``), ``auto`` (triton where CUDA and Triton exist). ``apply_kernels``
swaps them on module instances (``RMSNorm.fused``, ``FeedForward.gate``, ``Attention.core``), so the
model imports no Triton; call it before cp, which replaces ``Attention.core``."""
from __future__ import annotations

import importlib.util

import torch
from torch import nn

KINDS = ("eager", "triton", "auto")


def triton_available() -> bool:
    """True when the ``triton`` package can be imported (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def resolve_kernels(kind: str, cuda: bool | None = None) -> str:
    """``auto`` -> ``triton`` with CUDA and Triton, else ``eager``. Raises ValueError outside ``KINDS``."""
    if kind not in KINDS:
        raise ValueError(f"training.kernels ({kind!r}) must be one of {'|'.join(KINDS)}")
    if kind != "auto":
        return kind
    cuda = torch.cuda.is_available() if cuda is None else cuda
    return "triton" if cuda and triton_available() else "eager"


def apply_kernels(model: nn.Module, kind: str) -> dict[str, int]:
    """Install ``kind`` on ``model``'s modules in place; returns modules switched per op (all zero for
    eager, or auto on CPU). Attention with a head dim not a power of two >= 16 stays eager. Raises
    ValueError for an unknown kind."""
    params = list(model.parameters())
    kind = resolve_kernels(kind, cuda=params[0].is_cuda if params else None)  # auto follows the model's device
    counts = {"rmsnorm": 0, "swiglu": 0, "attention": 0}
    if kind == "eager":
        return counts
    from ndtrain.model.attention import Attention
    from ndtrain.model.mlp import FeedForward
    from ndtrain.model.norm import RMSNorm
    from ndtrain.ops.flash_attention.triton import flash_attention_bhtd
    from ndtrain.ops.rmsnorm.triton import fused_rmsnorm
    from ndtrain.ops.swiglu.triton import fused_swiglu

    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.fused = fused_rmsnorm
            counts["rmsnorm"] += 1
        elif isinstance(module, FeedForward):
            module.gate = fused_swiglu
            counts["swiglu"] += 1
        elif type(module) is Attention and module.head_dim >= 16 and not module.head_dim & (module.head_dim - 1):
            module.core = flash_attention_bhtd  # (B, H, T, D), (B, G, T, D) -> (B, H, T, D)
            counts["attention"] += 1
    return counts
