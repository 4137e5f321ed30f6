"""``training.compile`` and ``training.fp8``: compiled transformer blocks and float8 linear layers.

Compile (torchtitan's per-block regional compilation): ``torch.compile`` each block's ``forward``,
not the module call, so the module keeps its name, parameters and state dict (no ``_orig_mod``
prefix), and everything registered as module hooks stays eager around the compiled code: ZeRO-3's
gather / free, activation checkpointing's region enter / exit, tensor parallel's f at a region's
input, the zero-bubble output capture. The blocks share one code object, and with inlined
``nn.Module`` parameters (PyTorch's default) one compiled graph serves every block of the same
shapes, so a model compiles once, not once per layer. What runs inside a block (tensor parallel's
all-reduces, context parallel's ring exchange) is traced by Dynamo like any other op; a construct
it cannot trace becomes a graph break, which costs speed, not correctness.

FP8 (torchao float8 training; Micikevicius et al. 2022, "FP8 Formats for Deep Learning"): every
``nn.Linear`` inside the blocks whose in / out features are multiples of 16 becomes torchao's
``Float8Linear`` (dynamic tensorwise scaling: e4m3 forward, e5m2 gradients), the output head and
embedding stay in the compute dtype (as torchtitan does). Needs the optional ``torchao`` package
and a CUDA GPU of compute capability >= 8.9; ``ndtrain.config.validate`` rejects the rest before launch.
"""
from __future__ import annotations

import torch
from torch import nn


def apply_compile(model: nn.Module) -> int:
    """Compile the ``forward`` of every block in ``model.layers`` in place; returns how many.

    Call after activation checkpointing and tensor / context parallel (their hooks and core swaps
    must exist when the block is first traced) and before data parallel. Compilation itself
    happens at the first forward."""
    n = 0
    for block in getattr(model, "layers", {}).values():
        block.forward = torch.compile(block.forward)
        n += 1
    return n


def fp8_filter(module: nn.Module, fqn: str) -> bool:
    """torchao's ``module_filter_fn``: the blocks' linears with in / out features divisible by 16
    (the fp8 matmul's alignment), not the output head."""
    if not isinstance(module, nn.Linear):
        return False
    return fqn.startswith("layers.") and module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_fp8(model: nn.Module) -> int:
    """Swap the blocks' ``nn.Linear`` s for torchao ``Float8Linear`` in place (parameter names
    unchanged); returns how many. Raises ImportError without torchao (``ndtrain.config.validate``
    rejects ``training.fp8`` first)."""
    from torchao.float8 import convert_to_float8_training

    before = {n for n, m in model.named_modules() if isinstance(m, nn.Linear) and fp8_filter(m, n)}
    convert_to_float8_training(model, module_filter_fn=fp8_filter)
    return len(before)


def fp8_support(device: str = "auto") -> str:
    """"" when this machine can train in fp8, else why not (the validation rule's text)."""
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        return "training.fp8=true needs the torchao package (pip install 'ndtrain[fp8]')"
    if device == "cpu" or not torch.cuda.is_available():
        return "training.fp8=true needs a CUDA GPU (float8 matmuls); this run has none"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        return (f"training.fp8=true needs compute capability >= 8.9 (Ada / Hopper or newer); "
                f"{torch.cuda.get_device_name()} is {major}.{minor}")
    return ""
