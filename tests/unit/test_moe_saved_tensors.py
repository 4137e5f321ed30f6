"""What a MoE block keeps for backward under bf16 weights (ZeRO >= 1): ``moe_autograd``'s ops are
bitwise their plain twins, forward and gradients, and save no float32 copy of a bf16 tensor."""
from __future__ import annotations

import pytest
import torch

from ndtrain.model import moe_autograd


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
def test_router_logits_and_weighted_sum_are_bitwise_their_plain_twins(dtype):
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(37, 24, generator=gen).to(dtype), torch.randn(8, 24, generator=gen).to(dtype)
    rdt = torch.promote_types(dtype, torch.float32)
    for fn, ref in ((moe_autograd.router_logits, moe_autograd.router_logits_reference),):
        (out, grads), (want, wgrads) = _grads(lambda a, b: fn(a, b, rdt), x, w), _grads(lambda a, b: ref(a, b, rdt), x, w)
        assert out.dtype == rdt and torch.equal(out, want)
        assert all(torch.equal(a, b) for a, b in zip(grads, wgrads)) and grads[0].dtype == dtype
    y, s = torch.randn(37, 4, 24, generator=gen).to(dtype), torch.rand(37, 4, generator=gen).to(rdt)
    (out, grads) = _grads(lambda a, b: moe_autograd.weighted_sum(a, b, dtype), y, s)
    (want, wgrads) = _grads(lambda a, b: moe_autograd.weighted_sum_reference(a, b, dtype), y, s)
    assert out.dtype == dtype and torch.equal(out, want)
    assert all(torch.equal(a, b) for a, b in zip(grads, wgrads))
    idx = torch.randperm(60, generator=gen)[:37]
    (out, grads) = _grads(lambda a: moe_autograd.scatter_rows(a, idx, 60), x)
    (want, wgrads) = _grads(lambda a: moe_autograd.scatter_rows_reference(a, idx, 60), x)
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
