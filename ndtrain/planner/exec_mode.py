"""Execution mode of the memory-bound ops: ``eager`` PyTorch, ndtrain's ``kernels`` (Triton RMSNorm and
SwiGLU, ``training.kernels=triton``), or ``compile`` (``training.compile``: Inductor fuses every
pointwise chain; Megatron / NeMo / TE runs are fused the same way).

The GEMMs and the attention core are the same kernels in every mode; what differs is how many
kernels the norms, RoPE, SwiGLU product, residual adds and cross entropy launch and how many bytes
they move through HBM. Eager runs each PyTorch op as its own kernel, reading and writing full
tensors (RMSNorm alone is 8 kernels forward and 16 backward: the fp32 upcast, pow, mean, add,
rsqrt, two muls and the cast back). The eager figures below are counted from ndtrain's own code
(``model.norm.RMSNorm``, ``model.rope.apply_rope``, ``model.mlp._silu_gate``, the block's residual
adds, ``F.cross_entropy`` of ``parallel.batch``) by a dispatch-mode counter on CPU in bf16, which
records every non-view aten op and the bytes of its tensor inputs and outputs
(tests/unit/test_planner_exec_mode.py recounts them). Bytes are per element of the op's width:
h per token for norms and residuals, (heads x D) per token for RoPE of q or k, f per token for
SwiGLU, V per token for the loss. Per-row terms (the norm's rsqrt, the loss's per-token scalars)
and per-weight terms are left out: below 1 / width of the total.

The fused figures read each input and write each output once: RMSNorm read h write h (backward
twice the forward, as compute.py has always charged), RoPE read + write, SwiGLU read 2f write f,
residual read 2h write h, cross entropy read V and write the gradient V.

Each kernel also costs ``KERNEL_GAP_S`` (launch and tail: a dependent kernel cannot start before the
previous one drains, ~2-5 us on current GPUs), which matters only for small per-kernel tensors.
"""
from __future__ import annotations

from dataclasses import dataclass

MODES = ("compile", "kernels", "eager")
KERNEL_GAP_S = 3e-6


@dataclass(frozen=True)
class OpTraffic:
    """One op's kernels and HBM bytes per element of its width, forward and backward (bf16)."""

    fwd_kernels: int
    fwd_bytes: float
    bwd_kernels: int
    bwd_bytes: float


# eager, counted (see the module docstring); the residual's backward kernel is autograd summing the
# gradients of a tensor read twice (the block input feeds the norm and the add)
EAGER = {"rmsnorm": OpTraffic(8, 36, 16, 92), "rope": OpTraffic(9, 18, 8, 20),
         "swiglu": OpTraffic(2, 10, 3, 18), "residual": OpTraffic(1, 6, 1, 6),
         "cross_entropy": OpTraffic(2, 6, 2, 10),
         # the summed input gradient of linears that share an input (q, k, v: 2 adds; w1, w3: 1)
         "fanout_grad": OpTraffic(0, 0, 1, 6)}
FUSED = {"rmsnorm": OpTraffic(1, 4, 1, 8), "rope": OpTraffic(1, 4, 1, 8), "swiglu": OpTraffic(1, 6, 1, 12),
         "residual": OpTraffic(1, 6, 1, 12), "cross_entropy": OpTraffic(1, 4, 1, 4),
         "fanout_grad": OpTraffic(0, 0, 0, 0)}
KERNELS_FUSED = ("rmsnorm", "swiglu")  # what ``training.kernels=triton`` replaces


def op_table(mode: str) -> dict:
    """{op: OpTraffic} of ``mode``; raises ValueError for an unknown mode."""
    if mode not in MODES:
        raise ValueError(f"execution mode {mode!r} must be one of {'|'.join(MODES)}")
    if mode == "compile":
        return FUSED
    if mode == "eager":
        return EAGER
    return {k: (FUSED[k] if k in KERNELS_FUSED else v) for k, v in EAGER.items()}


def block_ops(spec, tokens: float, tp: int, sp: bool, moe: bool) -> dict:
    """Elements each memory-bound op of one block touches on one rank: {op: (elements, calls)}.
    Norms and residuals see tokens / tp under SP; RoPE q and k heads / tp; MoE: the top-k routed
    plus the shared experts' hidden widths."""
    h, D = spec.dim, spec.head_dim
    seq = tokens / tp if sp else tokens
    if moe:
        f = (spec.top_k * spec.moe_ffn_hidden + spec.n_shared_experts * spec.shared_ffn_hidden) / tp
    else:
        f = spec.ffn_hidden / tp
    return {"rmsnorm": (2 * seq * h, 2), "residual": (2 * seq * h, 2),
            "rope": (tokens * (spec.n_heads + spec.n_kv_heads) * D / tp, 2),
            "swiglu": (tokens * f, 1 if f else 0), "fanout_grad": (3 * tokens * h, 3)}


def block_memory_seconds(spec, tokens: float, tp: int, sp: bool, moe: bool, mode: str,
                         bw: float, e: int = 2) -> tuple[float, float]:
    """(forward, backward) seconds of one block's memory-bound ops on one rank at ``bw`` bytes/s
    (HBM bandwidth x efficiency), plus ``KERNEL_GAP_S`` per kernel. MoE permute / unpermute of the
    top-k copies (read + write h each, twice) is the same in every mode. ``e`` scales the bf16
    figures to another activation width (bytes per element / 2)."""
    table, scale = op_table(mode), e / 2
    fwd = bwd = 0.0
    for op, (elems, calls) in block_ops(spec, tokens, tp, sp, moe).items():
        t = table[op]
        fwd += scale * t.fwd_bytes * elems / bw + calls * t.fwd_kernels * KERNEL_GAP_S
        bwd += scale * t.bwd_bytes * elems / bw + calls * t.bwd_kernels * KERNEL_GAP_S
    if moe:
        perm = 4 * tokens * spec.top_k * spec.dim * e / bw
        fwd, bwd = fwd + perm, bwd + 2 * perm
    return fwd, bwd


def loss_memory_seconds(tokens: float, vocab_local: float, mode: str, bw: float, passes: int = 1) -> tuple[float, float]:
    """(forward, backward) seconds of the cross entropy over ``vocab_local`` logits per token."""
    t = op_table(mode)["cross_entropy"]
    el = passes * tokens * vocab_local
    return (t.fwd_bytes * el / bw + passes * t.fwd_kernels * KERNEL_GAP_S,
            t.bwd_bytes * el / bw + passes * t.bwd_kernels * KERNEL_GAP_S)
