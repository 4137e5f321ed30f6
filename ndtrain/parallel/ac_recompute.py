"""Recompute of named parts of each block; everything else is kept exactly as autograd saves it.

* ``core_attn`` - Megatron's selective recompute (Korthikanti et al. 2022, section 4.1): only the
  attention core softmax(QK^T)V is recomputed. Each block mixer's ``core`` (the attention kernel,
  or the ring / Ulysses / window core cp installed) runs under a non-reentrant
  ``torch.utils.checkpoint``: q, k, v are kept, the kernel's own saved state (scores and
  probabilities in the math kernel, output and log-sum-exp in a fused one) is not, and the core's
  forward runs again in backward (with its cp collectives). Mixers whose training forward calls no
  ``core`` (linear attention, Gated DeltaNet, Mamba-2, DSA) keep everything, as under ``none``.
* ``deepseek`` - DeepSeek-V3 (2024, section 3.2.3): every RMSNorm of a block and MLA's
  up-projections are recomputed in backward. A norm runs under a checkpoint (its internals are not
  kept) and its output is registered; while a block runs forward, a ``saved_tensors_hooks`` pack
  hook replaces any tensor autograd saves whose storage is a registered output by a recipe
  (function, inputs, autocast state, view geometry), and the unpack hook recomputes it once per
  backward under no_grad. So the consumers of a norm (wq / wk / wv, w1 / w3, the router) keep only
  the norm's input. A saved tensor that is not a view of a registered output (the all-gathered
  input of sequence parallelism, say) is kept as usual: exact either way, only the saving changes.
  MLA's ``attend`` (up-projections wq_b / wkv_b and the attention they feed) runs under a
  checkpoint that keeps only the latents: the per-head q, k, v are what the attention kernel saves,
  so they can only be dropped with it, and the attention core is recomputed with them.

Both leave the block's other matmul outputs, SwiGLU and RoPE tensors as under ``none``; the
recomputes are deterministic, so gradients are bitwise those of ``none``.
"""
from __future__ import annotations

import contextlib
import functools
import weakref

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ndtrain.model.norm import RMSNorm

_OPEN: list["_Registry"] = []  # the registry of the block whose forward is running (deepseek)


def _autocast_state() -> list[tuple[str, bool, torch.dtype]]:
    devs = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    return [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in devs]


class _Recipe:
    """``fn(*args)`` recomputed on first use, under no_grad and the forward's autocast state."""

    __slots__ = ("fn", "args", "autocast", "out")

    def __init__(self, fn, args):
        self.fn, self.args, self.autocast, self.out = fn, args, _autocast_state(), None

    def value(self, i: int) -> torch.Tensor:
        if self.out is None:
            with torch.no_grad(), contextlib.ExitStack() as stack:
                for dev, on, dtype in self.autocast:
                    stack.enter_context(torch.autocast(dev, dtype, enabled=on))
                out = self.fn(*self.args)
            self.out = out if isinstance(out, tuple) else (out,)
        return self.out[i]


class _Packed:
    """A saved tensor replaced by its recipe and view geometry."""

    __slots__ = ("recipe", "index", "size", "stride", "offset")

    def __init__(self, recipe: _Recipe, index: int, t: torch.Tensor):
        self.recipe, self.index = recipe, index
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()

    def unpack(self) -> torch.Tensor:
        return self.recipe.value(self.index).as_strided(self.size, self.stride, self.offset)


def _storage_id(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata  # the StorageImpl: shared by every view, distinct on meta
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


class _Registry:
    """Outputs registered during one block's forward, by storage; the pack / unpack hooks."""

    def __init__(self):
        self.outputs: dict[int, tuple[weakref.ref, _Recipe, int]] = {}

    def add(self, outs, recipe: _Recipe) -> None:
        for i, t in enumerate(outs if isinstance(outs, tuple) else (outs,)):
            sid = _storage_id(t)
            if sid is not None:
                self.outputs[sid] = (weakref.ref(t), recipe, i)

    def pack(self, t: torch.Tensor):
        hit = self.outputs.get(_storage_id(t)) if self.outputs and t.layout == torch.strided else None
        if hit is None:
            return t
        orig = hit[0]()
        # alive (so its storage was not reused) and the same element type (not a reinterpreting view)
        if orig is None or orig.dtype != t.dtype:
            return t
        return _Packed(hit[1], hit[2], t)

    @staticmethod
    def unpack(p):
        return p.unpack() if isinstance(p, _Packed) else p


def _norm_forward(fwd, x: torch.Tensor, *rest) -> torch.Tensor:
    """An RMSNorm's forward (``rest``: a gated norm's gate) kept as its inputs only."""
    if not (_OPEN and torch.is_grad_enabled()):
        return fwd(x, *rest)
    y = checkpoint(fwd, x, *rest, use_reentrant=False)  # keeps the inputs, not the fp32 copy / normalised x
    _OPEN[-1].add(y, _Recipe(fwd, (x, *rest)))
    return y


def _checkpointed_core(core, q, k, v, documents=None):
    """``core`` under a checkpoint (q, k, v kept); plain when no graph is built."""
    def run(q_, k_, v_, d_):
        return core(q_, k_, v_) if d_ is None else core(q_, k_, v_, documents=d_)
    if not torch.is_grad_enabled():
        return run(q, k, v, documents)
    return checkpoint(run, q, k, v, documents, use_reentrant=False)


def _checkpointed_attend(attend, q_in, c_kv, k_rope, cos, sin, documents=None):
    """MLA's up-projections and attention under a checkpoint: only the latents are kept."""
    if not torch.is_grad_enabled():
        return attend(q_in, c_kv, k_rope, cos, sin, documents)
    return checkpoint(attend, q_in, c_kv, k_rope, cos, sin, documents, use_reentrant=False)


class _BlockScope:
    """Forward pre / post hooks of one block: open a registry and the saved-tensor hooks."""

    def __init__(self, block: nn.Module):
        self.stack: list = []
        block.register_forward_pre_hook(self.enter)
        block.register_forward_hook(self.exit)

    def enter(self, module, args):
        if not torch.is_grad_enabled():
            return
        reg = _Registry()
        ctx = torch.autograd.graph.saved_tensors_hooks(reg.pack, reg.unpack)
        ctx.__enter__()
        _OPEN.append(reg)
        self.stack.append(ctx)

    def exit(self, module, args, output):
        if self.stack:
            self.stack.pop().__exit__(None, None, None)
            _OPEN.pop().outputs.clear()  # forward done: the packed recipes hold what they need


def _is_rms_norm(m: nn.Module) -> bool:
    """An RMSNorm, or tensor parallel's wrapper of one (``SequenceParallelNorm`` keeps its norm out of
    ``modules()``; its forward, the gain's all-reduce hook included, is what recomputes)."""
    from ndtrain.parallel.tp.layers import SequenceParallelNorm

    return isinstance(m, RMSNorm) or (isinstance(m, SequenceParallelNorm) and isinstance(m.norm, RMSNorm))


def apply_part_recompute(model: nn.Module, policy: str) -> int:
    """Install ``core_attn`` or ``deepseek`` (module docstring) on ``model.layers``; returns how many
    parts (cores, norms, MLA up-projections) recompute. Raises ValueError for another policy."""
    if policy not in ("core_attn", "deepseek"):
        raise ValueError(f"part recompute policy must be core_attn or deepseek, not {policy!r}")
    n = 0
    for block in model.layers.values():
        mixer = getattr(block, "attention", None)
        if policy == "core_attn":
            if mixer is not None and callable(getattr(mixer, "core", None)):
                mixer.__dict__["core"] = functools.partial(_checkpointed_core, mixer.core)
                n += 1
            continue
        _BlockScope(block)
        for m in block.modules():
            if _is_rms_norm(m):
                m.forward = functools.partial(_norm_forward, m.forward)
                n += 1
        if mixer is not None and callable(getattr(mixer, "attend", None)):  # MLA: keep only the latents
            mixer.attend = functools.partial(_checkpointed_attend, mixer.attend)
            n += 1
    return n
