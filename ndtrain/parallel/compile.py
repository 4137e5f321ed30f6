"""``training.compile`` and ``training.fp8``: compiled transformer blocks and float8 linears.

Compile (torchtitan's regional compilation): ``torch.compile`` each block's ``forward``, not the
module, so names and state dicts keep no ``_orig_mod`` prefix and module hooks (ZeRO-3 gather /
free, checkpoint regions, tp's f, zero-bubble capture) stay eager. The blocks share one code object,
so one graph serves every block of the same shapes. Untraceable constructs become graph breaks
(speed, not correctness).

FP8 (torchao float8 training; Micikevicius et al. 2022): the blocks' ``nn.Linear``s with features
divisible by 16 become ``Float8Linear`` (dynamic tensorwise scaling, e4m3 forward, e5m2 gradients);
head and embedding stay in the compute dtype. Needs ``torchao`` and compute capability >= 8.9."""
from __future__ import annotations

import torch
from torch import nn


def apply_compile(model: nn.Module) -> int:
    """Compile every block's ``forward`` in place; returns how many. Call after activation checkpointing
    and tp / cp (their hooks must exist at the first trace) and before dp."""
    n = 0
    for block in getattr(model, "layers", {}).values():
        block.forward = torch.compile(block.forward)
        n += 1
    return n


def fp8_filter(module: nn.Module, fqn: str) -> bool:
    """torchao's ``module_filter_fn``: the blocks' linears with features divisible by 16, not the head."""
    if not isinstance(module, nn.Linear):
        return False
    return fqn.startswith("layers.") and module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_fp8(model: nn.Module) -> int:
    """Swap the blocks' ``nn.Linear``s for ``Float8Linear`` in place (names unchanged); returns how many.
    Raises ImportError without torchao."""
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
