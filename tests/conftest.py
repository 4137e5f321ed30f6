"""Session-wide test setup.

Triton's CPU interpreter (``TRITON_INTERPRET=1``) must be on before Triton reads its settings,
which can happen in any earlier test that imports Triton indirectly (torch probes it); setting it
here, before any test module is imported, keeps the kernel tests' outcome independent of the
order and selection of tests. On a CUDA machine nothing changes: the real kernels run.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
