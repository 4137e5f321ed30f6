"""What a split backward (ZB-H1's B / W passes, ``parallel/pp/split_backward.py``) holds beyond
the graphs in flight: between a microbatch's B and its W, the gradient at every parameter owner's
output (the ``wgrads`` that W backpropagates into the owner's own weights).

Per token on one tp rank (widths as ``trainer_memory``: a query / g kv heads of D, SwiGLU hidden f
/ t, h the model width, ts = t under sequence parallelism), in the owner's output dtype e (the
norms' fp32 under autocast):

    dense block   norms 2 h / ts, wq a D, wk and wv g D each, wo h, w1 and w3 f each, w2 h
    MoE block     norms 2 h / ts, attention as above, router E (fp32), per routed copy (top-k) the
                  experts' output h, shared experts as a dense SwiGLU of f_s
    MLA           wq_a q_r, q_norm q_r, wq_b a (D + r), wkv_a k_r + r, kv_norm k_r, wkv_b a (D + v), wo h
    embedding     h (first stage)
    head          the final norm h / ts and the logits V / t (last stage; none under the fused loss,
                  whose op is not a module output)

W itself computes every owner's weight gradient before one backward accumulates them all into
``.grad`` (``accumulate_weight_grads``: data-parallel hooks fire once), so while it runs the stage's
gradients exist twice: the ``w_gradients`` transient, the stage's local parameters in their
compute dtype (fp32 weights under ZeRO 0, unsharded under every ZeRO stage).

The outputs themselves stay too: the pipeline's forward hook records every owner's output (or the
partial sum before a row-parallel / expert-parallel collective, ``weight_grad_output``) for W, so
every graph in flight holds them from F to W, also those no backward saves (``captured_outputs``:
q and k before RoPE and the full-width wo / w2 partial sums of each block, the logits on the last
stage without the fused loss).

Rank s of a p-stage ZB-H1 runs W_j right after B_{j+s} (``schedules.zero_bubble_h1``), so at its
peak it holds the gradients of min(s + 1, m) microbatches. Checked against the rehearsal:
``tests/rehearsal/test_zero_bubble_accounting.py``.
"""
from __future__ import annotations


def _attention_outputs(spec, tp: int) -> float:
    a, g, d, h = spec.n_heads / tp, max(spec.n_kv_heads / tp, 1.0), spec.head_dim, spec.dim
    if not spec.kv_lora_rank:
        return a * d + 2 * g * d + h
    qr, kr, r = spec.q_lora_rank, spec.kv_lora_rank, spec.qk_rope_head_dim
    dv = spec.v_head_dim or d
    q = 2 * qr + a * (d + r) if qr else a * (d + r)
    return q + (kr + r) + kr + a * (d + dv) + h


def owner_output_bytes(spec, tp: int, sp: bool, e: int, autocast: bool, moe: bool) -> float:
    """Bytes per token of one block's parameter owners' output gradients (module docstring)."""
    h, ts = spec.dim, (tp if sp else 1)
    norm_e = 4 if autocast else e
    out = 2 * h / ts * norm_e + _attention_outputs(spec, tp) * e
    if moe and spec.is_moe:
        out += 4 * spec.n_experts + spec.top_k * h * (4 if autocast else e)
        fs = spec.n_shared_experts * spec.shared_ffn_hidden / tp
        if fs:
            out += (2 * fs + h) * e
        return out
    return out + (2 * spec.ffn_hidden / tp + h) * e


def captured_output_bytes(spec, tp: int, e: int, moe: bool, ep: int) -> float:
    """Bytes per token of one block's recorded owner outputs that no backward saves, held by every
    graph in flight under a split backward (module docstring): q and k before RoPE (MLA: wq_b's
    output), the row-parallel wo and w2 partial sums (full width, before g), per routed copy the
    experts' GEMM output before the combine when ep > 1, the shared experts' w2 output. (The
    trainer runs split schedules without recompute, so no block's outputs are all unsaved.)"""
    h, a, g, d = spec.dim, spec.n_heads / tp, max(spec.n_kv_heads / tp, 1.0), spec.head_dim
    attn = a * (d + spec.qk_rope_head_dim) if spec.kv_lora_rank else (a + g) * d
    out = (attn + h) * e
    if moe and spec.is_moe:
        return out + (spec.top_k * h * e if ep > 1 else 0.0) + (h * e if spec.n_shared_experts else 0.0)
    return out + h * e


def split_pending_bytes(spec, lay, tokens: int, e: int, autocast: bool, n_layers: int, n_moe: int,
                        embedding: bool, head: bool, stage: int, n_micro: int, fused_loss: bool) -> float:
    """Bytes of output gradients rank ``stage`` holds for W at its peak under ``zero_bubble``
    (0 for other schedules): min(stage + 1, n_micro) microbatches of ``tokens`` tokens."""
    if lay.pp_schedule != "zero_bubble" or lay.pp <= 1:
        return 0.0
    per_tok = (n_layers - n_moe) * owner_output_bytes(spec, lay.tp, lay.seq_parallel, e, autocast, False)
    if n_moe:
        per_tok += n_moe * owner_output_bytes(spec, lay.tp, lay.seq_parallel, e, autocast, True)
    if embedding:
        per_tok += spec.dim * (4 if autocast else e)
    if head:
        per_tok += spec.dim / (lay.tp if lay.seq_parallel else 1) * (4 if autocast else e)
        if not fused_loss:
            per_tok += -(-spec.vocab_size // lay.tp) * e
    return per_tok * tokens * min(stage + 1, n_micro)


def w_gradient_bytes(lay, local_params: float, param_bytes: int) -> float:
    """The W pass's gradient transient under ``zero_bubble`` (module docstring), 0 otherwise."""
    if lay.pp_schedule != "zero_bubble" or lay.pp <= 1:
        return 0.0
    return local_params * param_bytes
