"""LoRA: low-rank adapters on frozen linears (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large
Language Models"): y = W x + (alpha / r) * B (A dropout(x)), W (out, in) frozen, A (r, in)
Kaiming-uniform, B (out, r) zero, so training starts from the base model exactly.

The adapters are registered on the target module itself as ``lora_A`` / ``lora_B`` and added by a
forward hook, so the base weight keeps its name (``layers.0.attention.wq.weight``: checkpoints,
Hugging Face import and the tensor-parallel plan see the model they know) and the adapters are
``layers.0.attention.wq.lora_A`` / ``.lora_B``. The hook reads the parameters from the module at
call time, so data-parallel wrappers that swap them (ZeRO-3 gathers) keep working. This module is
the single-device path (``nn.Linear``); ``ndtrain.parallel.lora`` attaches the same adapters to
tensor-parallel linears with their split.

Initialisation is a function of (``training.seed``, module name, global shape) only, so every
layout starts from the same adapters (a pipeline stage or tp rank cuts its slice of the same A).
"""
from __future__ import annotations

import fnmatch
import math
import zlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

ADAPTERS = ("lora_A", "lora_B")
HOOK_ATTR = "_ndtrain_lora_hook"


def is_adapter(name: str) -> bool:
    """True for a parameter / state-dict name of a LoRA adapter (``...wq.lora_A``)."""
    return name.rsplit(".", 1)[-1] in ADAPTERS


def parse_targets(text: str) -> list[str]:
    """``"*.wq, *.wv"`` -> ``["*.wq", "*.wv"]`` (empty entries dropped)."""
    return [t.strip() for t in text.split(",") if t.strip()]


def find_targets(model: nn.Module, patterns: list[str], accept: Callable[[nn.Module], bool]) -> list[str]:
    """Names of the modules of ``model`` matching any fnmatch ``pattern``, in registration order.

    Raises ValueError for a matched module ``accept`` refuses (not a linear this code adapts), and
    for a pattern that matches nothing (a typo must not train the base model's adapters silently)."""
    names, used = [], set()
    for name, mod in model.named_modules():
        hits = [p for p in patterns if fnmatch.fnmatchcase(name, p)]
        if not hits:
            continue
        if not accept(mod):
            raise ValueError(f"finetune.lora_targets: {name} ({type(mod).__name__}, matched by {hits[0]!r}) "
                             "is not a bias-free linear LoRA can adapt")
        names.append(name)
        used.update(hits)
    unused = [p for p in patterns if p not in used]
    if unused:
        raise ValueError(f"finetune.lora_targets: {unused[0]!r} matches no module of this model "
                         "(names look like layers.0.attention.wq, layers.0.feed_forward.w1)")
    return names


def init_adapter(name: str, in_features: int, out_features: int, rank: int, seed: int,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole (A (r, in), B (out, r)) of the adapter on module ``name``: A Kaiming-uniform with
    a = sqrt(5) (bound 1 / sqrt(in), as ``nn.Linear`` and PEFT draw it), B zero. The CPU generator is
    seeded from ``seed`` and the name's CRC-32 only, so the values do not depend on the layout."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)) on fan_in = in_features
    a = (torch.rand(rank, in_features, generator=g, dtype=torch.float64) * 2 - 1) * bound
    return a.to(dtype), torch.zeros(out_features, rank, dtype=dtype)


def attach(mod: nn.Module, a: torch.Tensor, b: torch.Tensor, scale: float, dropout: float,
           delta: Callable | None = None) -> None:
    """Register ``lora_A`` = ``a``, ``lora_B`` = ``b`` (trainable) on ``mod`` and the hook that adds
    ``delta(mod, x)`` (default: the single-device ``scale * B A dropout(x)``) to its output.
    ``mod.lora_scale`` / ``mod.lora_dropout`` hold the two numbers."""
    mod.register_parameter("lora_A", nn.Parameter(a))
    mod.register_parameter("lora_B", nn.Parameter(b))
    mod.lora_scale, mod.lora_dropout = scale, dropout
    fn = delta or lora_delta
    handle = mod.register_forward_hook(lambda m, args, out: out + fn(m, args[0]))
    setattr(mod, HOOK_ATTR, handle)


def lora_delta(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The adapter's output: scale * B (A dropout(x)). x (..., in) -> (..., out)."""
    x = F.dropout(x, mod.lora_dropout, mod.training) if mod.lora_dropout else x
    return F.linear(F.linear(x, mod.lora_A), mod.lora_B) * mod.lora_scale  # (..., r) -> (..., out)


def freeze_base(model: nn.Module) -> int:
    """``requires_grad = False`` on every parameter that is not an adapter; returns how many."""
    n = 0
    for name, p in model.named_parameters():
        if not is_adapter(name):
            p.requires_grad_(False)
            n += 1
    return n


def apply_lora(model: nn.Module, cfg, seed: int) -> list[str]:
    """Single-device LoRA on ``model`` in place from ``cfg`` (a ``FinetuneConfig``): adapters on
    every ``nn.Linear`` the targets match, in the parameters' dtype, everything else frozen.
    Returns the adapted module names. Raises ValueError (see ``find_targets``)."""
    names = find_targets(model, parse_targets(cfg.lora_targets), is_plain_linear)
    for name in names:
        lin = model.get_submodule(name)
        a, b = init_adapter(name, lin.in_features, lin.out_features, cfg.lora_rank, seed, lin.weight.dtype)
        attach(lin, a.to(lin.weight.device), b.to(lin.weight.device), cfg.lora_alpha / cfg.lora_rank,
               cfg.lora_dropout)
    freeze_base(model)
    return names


def is_plain_linear(mod: nn.Module) -> bool:
    return type(mod) is nn.Linear and mod.bias is None


@torch.no_grad()
def merge_lora(model: nn.Module) -> int:
    """Fold every adapter into its base weight (W += scale * B A, in float64 then cast back) and
    remove it and its hook, leaving the plain model; returns how many were merged."""
    n = 0
    for mod in model.modules():
        handle = getattr(mod, HOOK_ATTR, None)
        if handle is None:
            continue
        w = mod.weight
        w.copy_((w.double() + mod.lora_scale * (mod.lora_B.double() @ mod.lora_A.double())).to(w.dtype))
        handle.remove()
        for k in ADAPTERS:
            del mod._parameters[k]
        delattr(mod, HOOK_ATTR)
        n += 1
    return n


def merged_state(sd: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A whole state dict with adapters -> the merged one (``X.weight + scale * X.lora_B @ X.lora_A``,
    float64 accumulate, the weight's dtype back), adapters dropped."""
    out = {k: v for k, v in sd.items() if not is_adapter(k)}
    for k, a in sd.items():
        if k.endswith(".lora_A"):
            base = k[: -len(".lora_A")]
            w = sd[base + ".weight"]
            delta = sd[base + ".lora_B"].double() @ a.double()
            out[base + ".weight"] = (w.double() + scale * delta).to(w.dtype)
    return out
