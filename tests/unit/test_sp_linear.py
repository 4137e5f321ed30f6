"""``parallel/tp/sp_linear.py`` in one process (a size-1 tp group, so the gathers are copies): the
shard-saving column linears against plain ``F.linear`` on the gathered input, in float32 and under
bf16 autocast; the region's linears share one cast of the shard and free the backward gather."""
from __future__ import annotations

import contextlib

import pytest
import torch

from ndtrain.mesh import AxisGroup
from ndtrain.parallel.tp import sp_linear
from ndtrain.parallel.tp.collectives import GatherFromSequence

GROUP = AxisGroup("tp", 1, 0, None)


def _region(regather: bool, amp: bool) -> dict:
    """A (2, 8, 16) input through three column linears (16 -> 12) sharing one gathered input."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 16, generator=g).requires_grad_()
    ws = [torch.randn(12, 16, generator=g).requires_grad_() for _ in range(3)]
    sp_linear.REGATHER = regather
    saved = []
    try:
        amp_ctx = torch.autocast("cpu", torch.bfloat16) if amp else contextlib.nullcontext()
        with amp_ctx, torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            full = sp_linear.tag_gathered(GatherFromSequence.apply(x, GROUP, 1), x, GROUP, 1)
            ys = [sp_linear.linear(full, w) for w in ws]
        rec = getattr(full, sp_linear.GATHERED_ATTR, None)
        sum((y.float() * (i + 1)).sum() for i, y in enumerate(ys)).backward()
    finally:
        sp_linear.REGATHER = True
    return {"ys": ys, "grads": [x.grad] + [w.grad for w in ws], "rec": rec,
            "saved": {t.untyped_storage().data_ptr(): t for t in saved}}


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16_autocast"])
def test_shard_path_equals_plain_linear(amp):
    ref, new = _region(False, amp), _region(True, amp)
    assert ref["rec"] is None and new["rec"] is not None
    for a, b in zip(ref["ys"] + ref["grads"], new["ys"] + new["grads"]):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert [g.dtype for g in new["grads"]] == [torch.float32] * 4  # grads in the leaves' dtype
    cache = new["rec"].cache
    assert cache.users == 0 and cache.full is None  # the last backward freed the gathered input
    shards = [t for t in new["saved"].values() if t.shape == (2, 8, 16)]
    assert len(shards) == 1  # one (cast) shard saved for the three linears
    assert shards[0].dtype == (torch.bfloat16 if amp else torch.float32)


def test_untagged_input_takes_plain_linear():
    x, w = torch.randn(2, 4, 8), torch.randn(3, 8)
    assert torch.equal(sp_linear.linear(x, w), torch.nn.functional.linear(x, w))
