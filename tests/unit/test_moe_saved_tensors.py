"""What a MoE block keeps for backward under bf16 weights (ZeRO >= 1): ``moe_autograd``'s ops are
bitwise their plain twins, forward and gradients, and save no float32 copy of a bf16 tensor; one
DeepSeek-V3-like block (MLA + MoE with a shared expert) keeps exactly what the planner's trainer
accounting says, tensor class by tensor class."""
from __future__ import annotations

import pytest
import torch

from ndtrain.config import load_config
from ndtrain.model import build_model, moe_autograd
from ndtrain.planner.model_spec import from_model_config
from ndtrain.planner.trainer_memory import trainer_layer_bytes

B, T = 2, 64


def _grads(fn, *inputs):
    """fn(*inputs) and the gradients of a fixed random projection of it w.r.t. every input."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*leaves)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    out.backward(g)
    return out.detach(), [t.grad for t in leaves if t.requires_grad]


def _saved(fn, *inputs) -> list[tuple[torch.dtype, tuple]]:
    """(dtype, shape) of every tensor fn's graph saves, by storage (an input saved as is counts too)."""
    seen, rows = set(), []

    def pack(t):
        if t.untyped_storage()._cdata not in seen:
            seen.add(t.untyped_storage()._cdata)
            rows.append((t.dtype, tuple(t.shape)))
        return t
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*leaves)
    return rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_the_ops_are_bitwise_their_plain_twins(dtype):
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(37, 24, generator=gen).to(dtype), torch.randn(8, 24, generator=gen).to(dtype)
    rdt = torch.promote_types(dtype, torch.float32)
    out, grads = _grads(lambda a, b: moe_autograd.router_logits(a, b, rdt), x, w)
    want, wgrads = _grads(lambda a, b: moe_autograd.router_logits_reference(a, b, rdt), x, w)
    assert out.dtype == rdt and torch.equal(out, want)
    assert all(torch.equal(a, b) for a, b in zip(grads, wgrads)) and grads[0].dtype == dtype
    y, s = torch.randn(37, 4, 24, generator=gen).to(dtype), torch.rand(37, 4, generator=gen).to(rdt)
    out, grads = _grads(lambda a, b: moe_autograd.weighted_sum(a, b, dtype), y, s)
    want, wgrads = _grads(lambda a, b: moe_autograd.weighted_sum_reference(a, b, dtype), y, s)
    assert out.dtype == dtype and torch.equal(out, want)
    assert all(torch.equal(a, b) for a, b in zip(grads, wgrads))
    idx = torch.randperm(60, generator=gen)[:37]
    out, grads = _grads(lambda a: moe_autograd.scatter_rows(a, idx, 60), x)
    want, wgrads = _grads(lambda a: moe_autograd.scatter_rows_reference(a, idx, 60), x)
    assert torch.equal(out, want) and torch.equal(grads[0], wgrads[0])
    assert out[idx].equal(x) and int((out.abs().sum(1) > 0).sum()) <= 37  # unlisted rows are 0


def test_the_ops_save_the_bf16_tensors_not_their_float32_copies():
    """bf16 in: the router saves x and w as given (its plain twin: their (37, 24), (8, 24) float32
    copies), the weighted sum y as given (twin: the float32 (37, 4, 24) copy), the scatter only its
    index (``index_copy`` keeps its source)."""
    bf, f32 = torch.bfloat16, torch.float32
    x, w = torch.randn(37, 24).to(bf), torch.randn(8, 24).to(bf)
    assert _saved(lambda a, b: moe_autograd.router_logits(a, b, f32), x, w) == [(bf, (37, 24)), (bf, (8, 24))]
    assert sorted(_saved(lambda a, b: moe_autograd.router_logits_reference(a, b, f32), x, w), key=str) == [
        (f32, (24, 8)), (f32, (37, 24))]
    y, s = torch.randn(37, 4, 24).to(bf), torch.rand(37, 4)
    assert _saved(lambda a, b: moe_autograd.weighted_sum(a, b, bf), y, s) == [(bf, (37, 4, 24)), (f32, (37, 4))]
    assert (f32, (37, 4, 24)) in _saved(lambda a, b: moe_autograd.weighted_sum_reference(a, b, bf), y, s)
    idx = torch.randperm(60)[:37]
    assert _saved(lambda a: moe_autograd.scatter_rows(a, idx, 60), x) == [(torch.int64, (37,))]
    assert (bf, (37, 24)) in _saved(lambda a: moe_autograd.scatter_rows_reference(a, idx, 60), x)


def _block_saved_bytes(cfg, block: str) -> tuple[int, dict]:
    """Bytes of the tensors first saved inside module ``block`` during a bf16 forward (parameters
    bf16 as ZeRO-1 leaves them, autocast on as the trainer runs), by storage; and by dtype."""
    torch.manual_seed(0)
    model = build_model(cfg.model, "cpu", torch.float32)
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    stack, seen = ["root"], {}
    for name, m in model.named_modules():
        if name:
            m.register_forward_pre_hook(lambda m, i, name=name: stack.append(name))
            m.register_forward_hook(lambda m, i, o: stack.pop() and None)  # None: the output stays

    def pack(t):
        key = t.untyped_storage()._cdata
        if key not in params and key not in seen:
            seen[key] = (stack[-1], t.dtype, t.untyped_storage().nbytes())
        return t
    x = torch.randint(0, cfg.model.vocab_size, (B, T))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", torch.bfloat16):
        model(x)
    mine = [(dt, n) for mod, dt, n in seen.values() if mod.startswith(block)]
    by_dtype: dict = {}
    for dt, n in mine:
        by_dtype[dt] = by_dtype.get(dt, 0) + n
    return sum(n for _, n in mine), by_dtype


def test_a_deepseek_block_under_bf16_keeps_what_the_accounting_says():
    """deepseek_v3_debug at width 128, block 2 (MLA; MoE 16 experts top-4 + a shared expert), bf16
    weights: the saved bytes equal ``trainer_layer_bytes(kind="lowp", e=2)`` but for two terms it
    leaves out: RoPE's cos / sin casts, counted there at head_dim / 2 where MLA rotates
    rope_dim / 2, and per microbatch E floats per sequence (the sequence-wise balance loss) and the
    three grouped GEMMs' (E,) int32 offsets. Before ``moe_autograd`` the block kept 335,872 bytes
    more: the router's float32 input (65,536) and weight (8,192), the combine's float32 product
    (131,072 more than bf16) and the scatter's source (131,072)."""
    cfg = load_config("deepseek_v3_debug", {"model.n_layers": 3, "model.max_seq_len": T, "data.seq_len": T,
                                            "model.mtp_depth": 0, "model.dim": 128, "model.ffn_hidden": 256,
                                            "model.vocab_size": 256})
    measured, by_dtype = _block_saved_bytes(cfg, "layers.2")
    spec = from_model_config(cfg.model)
    plan = trainer_layer_bytes(spec, B * T, T, moe=True, kind="lowp", e=2)
    rope = 4 * (spec.qk_rope_head_dim // 2) * 2 * T  # cos, sin of q and k at the T positions, bf16
    per_microbatch = (B + 3) * 4 * spec.n_experts
    assert measured - rope - per_microbatch == plan["total"] - plan["rope"]
    # the float32 ones: norms' input copies and rsqrt, router scores, routing weights, math SDPA's upcasts
    assert by_dtype[torch.float32] < measured / 2
