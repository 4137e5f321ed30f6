"""Shared by the kernel tests: Triton's CPU interpreter switch and the relative-RMS error.

``TRITON_INTERPRET=1`` must be set before ``triton.jit`` decorates a kernel, so every kernel test
module imports this module before any ``ndtrain.ops.*.triton`` module (and skips when triton is
missing). On a CUDA machine the ``gpu``-marked tests run the real kernels instead.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def grads(fn, inputs: list[torch.Tensor], dout: torch.Tensor | None = None):
    """Output of ``fn(*inputs)`` and the gradients of <out, dout> wrt every input."""
    out = fn(*inputs)
    dout = torch.randn_like(out) if dout is None else dout
    return out, torch.autograd.grad(out, inputs, dout), dout
