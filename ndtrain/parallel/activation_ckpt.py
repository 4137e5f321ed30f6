"""Activation checkpointing policies for the transformer blocks (``training.activation_checkpoint``).

* ``none``      - keep every activation.
* ``full``      - each block is a segment: only its input is kept, everything inside is recomputed
  during backward (Chen et al. 2016; Megatron "full recompute"). Memory O(L) block inputs + one
  block's activations.
* ``every:C``   - segments of C consecutive blocks (Chen et al. 2016, "Training Deep Nets with
  Sublinear Memory Cost"), two-level: only every C-th block input is kept; the backward of a
  segment first recomputes the segment keeping just its C block inputs, then each block recomputes
  its own activations. Memory O(L / C + C) block inputs + one block's activations, for two extra
  forwards (C = 1 is ``full``).
* ``sqrt``      - ``every:C`` with C = round(sqrt(L)): O(sqrt(L)) block inputs.
* ``selective`` - per block, keep the outputs of matrix multiplies (``aten.mm / addmm / bmm``)
  and recompute everything else: the attention core (softmax(QK^T)V, whose saved state grows with
  T^2 in a non-fused kernel) and the elementwise ops (RoPE, SiLU, products, norms). No matmul is
  recomputed, as in Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
  Transformer Models"), but elementwise tensors are dropped too. Implemented as a per-op policy
  with ``torch.utils.checkpoint.create_selective_checkpoint_contexts``.
* ``op``        - torchtitan's op-level selective checkpointing: as ``selective``, and the outputs
  of the fused attention kernels (``aten._scaled_dot_product_*_attention``: output and log-sum-exp)
  are kept too, so the attention core is not recomputed; norms and elementwise ops are.
* ``core_attn`` / ``deepseek`` - recompute of named parts only (Megatron's core-attention
  recompute; DeepSeek-V3's RMSNorm and MLA up-projection recompute): ``ndtrain.parallel.ac_recompute``.

Mechanism: ``torch.utils.checkpoint``'s non-reentrant checkpoint (its generator form), opened in
the first block's forward pre-hook and closed in the last block's forward hook of each region, so
module names, parameters and other forward hooks (ZeRO-3's gather / free) are untouched. Segments
of ``every:C`` are level-0 regions holding one level-1 region per block (torch saves a nested
region's inputs through the enclosing region, so they are dropped and recomputed). A recompute
replays the region's blocks through their ``__call__``, re-opening only deeper regions; RNG state (CPU and CUDA) is stashed when the
segment starts and restored for the recompute (``preserve_rng_state``), so dropout masks match;
autocast state is restored too. Blocks called without grad (evaluation, generation with a KV
cache) are not checkpointed. The policy string is parsed by ``ndtrain.parallel.ac_policy``.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts, noop_context_fn

from ndtrain.parallel.ac_policy import parse_policy  # the one parser (also used by validation, planner)

_REPLAYING: list[int] = []  # levels of the regions replaying their blocks (checkpoint recompute)
_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
_aten = torch.ops.aten
# fused attention kernels whose outputs the op policy keeps (torchtitan's save list, plus the CPU one)
_SDPA = {getattr(_aten, n).default for n in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu") if hasattr(_aten, n)}


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


def _keep_matmuls_and_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _MATMULS or op in _SDPA else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context_fn():
    """Forward / recompute contexts of the selective policy (matmul outputs are saved)."""
    return create_selective_checkpoint_contexts(_keep_matmuls)


def op_context_fn():
    """Forward / recompute contexts of the op policy (matmul and fused-attention outputs are saved)."""
    return create_selective_checkpoint_contexts(_keep_matmuls_and_attention)


class _Region:
    """Consecutive blocks checkpointed as one region at nesting ``level`` (0 outer, 1 per block)."""

    def __init__(self, blocks: list[nn.Module], level: int, context_fn):
        self.blocks, self.level, self.context_fn, self._gen = blocks, level, context_fn, None

    def hook_enter(self) -> None:
        self.handles = [self.blocks[0].register_forward_pre_hook(self._enter)]

    def hook_exit(self) -> None:
        self.handles.append(self.blocks[-1].register_forward_hook(self._exit))

    def _enter(self, module, args):
        replaying = _REPLAYING[-1] if _REPLAYING else -1
        if not torch.is_grad_enabled() or replaying >= self.level or (len(args) > 3 and args[3] is not None):
            return
        from torch.utils.checkpoint import _checkpoint_without_reentrant_generator

        self._gen = _checkpoint_without_reentrant_generator(
            self._replay, True, self.context_fn, "default", False, True, *args[:3], *args[4:5])
        next(self._gen)  # stash RNG, start discarding saved tensors

    def _exit(self, module, args, output):
        if self._gen is not None:
            gen, self._gen = self._gen, None
            next(gen, None)  # leave the region

    def _replay(self, x, cos, sin, documents=None):
        _REPLAYING.append(self.level)
        try:
            for block in self.blocks:  # documents: the packed ids the block was called with (args[4])
                x = block(x, cos, sin) if documents is None else block(x, cos, sin, None, documents)  # (B, T, C)
            return x
        finally:
            _REPLAYING.pop()


def apply_activation_checkpoint(model: nn.Module, policy: str) -> list[_Region]:
    """Checkpoint ``model.layers`` by ``policy`` (see module docstring); returns the regions.

    Blocks are called as ``block(x, cos, sin, kv_cache=None[, documents])``. Raises ValueError for an unknown
    policy or a model without ``layers``.
    """
    if not hasattr(model, "layers"):
        raise ValueError("activation checkpointing needs a model with a `layers` ModuleDict")
    blocks = list(model.layers.values())
    kind, c = parse_policy(policy, len(blocks))
    if kind == "none":
        return []
    if kind == "parts":  # no block regions: norms / cores / MLA up-projections are recomputed
        from ndtrain.parallel.ac_recompute import apply_part_recompute

        apply_part_recompute(model, policy)
        return []
    ctx = {"selective": selective_context_fn, "op": op_context_fn}.get(policy, noop_context_fn)
    regions = []
    for i in range(0, len(blocks), c):
        seg = blocks[i:i + c]
        outer = _Region(seg, 0, ctx) if len(seg) > 1 else None
        inner = [_Region([b], 1, ctx) for b in seg]
        if outer:  # hook order: outer enters before, and exits after, the per-block regions
            outer.hook_enter()
        for r in inner:
            r.hook_enter()
            r.hook_exit()
        if outer:
            outer.hook_exit()
        regions += ([outer] if outer else []) + inner
    return regions
