"""What a checkpoint load hands to the optimizer is contiguous, in storage of its own.

torch's ``Optimizer.load_state_dict`` keeps the tensors it is given as the AdamW moments, and its
fused CPU kernel updates non-contiguous moments wrongly. The tensor-parallel scatter used to give
each rank a ``narrow`` view of the gathered tensor: for a row-parallel weight (split along dim 1) a
non-contiguous one, so a resumed tp run drifted from the uninterrupted one. No process group here
(``FakeMesh``): scattering only slices.
"""
from __future__ import annotations

import torch

from ndtrain.model import build_model
from ndtrain.parallel.state import CheckpointAdapter
from ndtrain.parallel.tp.state import scatter_tp_state
from ndtrain.parallel.tp.tensor_parallel import apply_tp
from tests.parallel.layout_parity import tiny_cfg
from tests.parallel.test_tp import FakeMesh

ROW = "layers.0.attention.wo.weight"  # (C, H*D) split along dim 1 over tp


def _full_state(model) -> dict:
    g = torch.Generator().manual_seed(3)
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = {n: {"step": torch.tensor(3.0, dtype=torch.float64),
                   "exp_avg": torch.randn(t.shape, dtype=t.dtype, generator=g),
                   "exp_avg_sq": torch.rand(t.shape, dtype=t.dtype, generator=g)} for n, t in full.items()}
    return {"model": full, "optim": {"state": moments}}


def _tp_model(rank: int):
    model = build_model(tiny_cfg().model, "cpu", torch.float64, 0)
    state = _full_state(model)
    apply_tp(model, FakeMesh(rank, tp=2))
    return model, state


def test_scattered_slices_are_contiguous_in_their_own_storage():
    model, state = _tp_model(1)
    out = scatter_tp_state(state, model, FakeMesh(1, tp=2))
    tensors = list(out["model"].values()) + [t for st in out["optim"]["state"].values()
                                             for k, t in st.items() if k != "step"]
    assert len(tensors) == 3 * len(out["model"])
    for t in tensors:
        assert t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    want = state["optim"]["state"][ROW]["exp_avg"][:, 16:32]  # rank 1's half of the columns
    assert torch.equal(out["optim"]["state"][ROW]["exp_avg"], want)


def test_fused_adamw_after_a_tp_load_steps_like_a_fresh_copy():
    """The scattered moments loaded into fused AdamW give exactly the update of contiguous copies
    of the same values (a non-contiguous ``exp_avg`` of ``wo`` gives another one)."""
    model, state = _tp_model(0)
    moments = scatter_tp_state(state, model, FakeMesh(0, tp=2))["optim"]["state"]
    copies = {n: {k: v.clone(memory_format=torch.contiguous_format) for k, v in st.items()} for n, st in moments.items()}
    names = [n for n, _ in model.named_parameters()]
    results = []
    for given in (moments, copies):  # the optimizer updates them in place: each used once
        params = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
        opt = torch.optim.AdamW(params, lr=1e-2, fused=True)
        st = {i: dict(given[n], step=given[n]["step"].clone()) for i, n in enumerate(names)}
        opt.load_state_dict({"state": st, "param_groups": [dict(opt.state_dict()["param_groups"][0])]})
        for i, p in enumerate(params):
            p.grad = torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(i))
        opt.step()
        results.append(params[names.index(ROW)].detach())
    assert torch.equal(results[0], results[1])


class _Recorder:
    """A gradient-sync stand-in that keeps what the adapter hands it."""

    def __init__(self, model):
        self.model, self.got = model, {}

    def optim_state_dict(self, optimizer):
        return {"state": {}, "param_groups": [{"params": [n for n, _ in self.model.named_parameters()], "lr": 0.1}]}

    def load_model_state_dict(self, sd):
        self.got["model"] = sd

    def load_optim_state_dict(self, optimizer, sd):
        self.got["optim"] = sd


def test_checkpoint_adapter_hands_over_contiguous_tensors():
    """Whatever the layout's own resharding gives, ``CheckpointAdapter.load`` / ``load_model``
    pass contiguous tensors to the data-parallel wrapper (and so to the optimizer)."""
    model = build_model(tiny_cfg().model, "cpu", torch.float64, 0)
    state = _full_state(model)
    for tree in (state["optim"]["state"][ROW], state["model"]):  # same values, transposed strides
        key = "exp_avg" if tree is not state["model"] else ROW
        tree[key] = tree[key].t().contiguous().t()
    state["optim"]["param_groups"] = {n: {"lr": 0.2} for n, _ in model.named_parameters()}
    assert not state["optim"]["state"][ROW]["exp_avg"].is_contiguous()
    rec = _Recorder(model)
    adapter = CheckpointAdapter(model, rec, FakeMesh(0))
    adapter.load(state, optimizer=None)
    got = rec.got["optim"]["state"][ROW]["exp_avg"]
    assert got.is_contiguous() and torch.equal(got, state["optim"]["state"][ROW]["exp_avg"])
    assert rec.got["optim"]["param_groups"][0]["lr"] == 0.2
    assert rec.got["model"][ROW].is_contiguous() and torch.equal(rec.got["model"][ROW], state["model"][ROW])
    adapter.load_model({ROW: state["model"][ROW]})
    assert rec.got["model"][ROW].is_contiguous()
