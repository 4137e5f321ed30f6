"""Which implementation of the model's hot ops a run uses (``training.kernels``).

* ``eager``  - PyTorch ops (the model's own forward code; the reference).
* ``triton`` - Triton kernels from ``ndtrain.ops``: ``fused_rmsnorm`` for every RMSNorm,
  ``fused_swiglu`` for the SwiGLU gate of every dense feed-forward, and FlashAttention-2
  (``flash_attention_bhtd``) as the causal attention core. Needs CUDA, or ``TRITON_INTERPRET=1``
  (Triton's CPU interpreter: slow, for tests).
* ``auto``   - ``triton`` where CUDA is present and Triton imports, else ``eager``.

``apply_kernels(model, kind)`` swaps the implementations on module instances from outside, like the
parallel axes do, so the model code stays single-device and free of Triton imports: ``RMSNorm.fused``,
``FeedForward.gate`` and ``Attention.core`` are the hooks. Call it before context parallel, which
replaces ``Attention.core`` with its ring / Ulysses core (the ring core keeps its own kernel).
"""
from __future__ import annotations

import importlib.util

import torch
from torch import nn

KINDS = ("eager", "triton", "auto")


def triton_available() -> bool:
    """True when the ``triton`` package can be imported (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def resolve_kernels(kind: str, cuda: bool | None = None) -> str:
    """``auto`` -> ``triton`` with CUDA and Triton installed, else ``eager``; other kinds unchanged.

    Raises ValueError for a kind outside ``KINDS``.
    """
    if kind not in KINDS:
        raise ValueError(f"training.kernels ({kind!r}) must be one of {'|'.join(KINDS)}")
    if kind != "auto":
        return kind
    cuda = torch.cuda.is_available() if cuda is None else cuda
    return "triton" if cuda and triton_available() else "eager"


def apply_kernels(model: nn.Module, kind: str) -> dict[str, int]:
    """Install the ``kind`` implementations on ``model``'s modules in place; returns how many
    modules of each op were switched (all zero for ``eager``, and for ``auto`` on a CPU model). Attention modules whose head dim is
    not a power of two >= 16 keep the eager core. Raises ValueError for an unknown kind."""
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
