"""Every weight-gradient reduction honours ``parallel.grad_reduce_dtype``.

Setup: 2 gloo ranks, ``training.dtype=bfloat16`` (bf16 autocast; ZeRO keeps bf16 model parameters),
one forward, then backward + ``finish_grad_sync`` under a recorder that wraps the
``torch.distributed`` calls ndtrain's collectives end in (``dist.all_reduce``, the flat all-gather /
reduce-scatter of ``ndtrain.parallel.comm``, ``all_to_all_single``, ``batch_isend_irecv``). Each
call is classified by the ndtrain function that issued it (the innermost frame outside
``comm.py``):

* weight-gradient reductions: every all-reduce / reduce-scatter issued by the data-parallel
  wrappers (``parallel/dp/``, ``parallel/zero/``: DDP and expert-DDP buckets, ZeRO reduce-scatters,
  the HSDP all-reduce) and tensor parallel's ``all_reduce_grad`` (SP norm gains, replicated kv
  weights). They must run in ``grad_reduce_dtype``, and each one's result must equal the sum of
  the ranks' inputs taken in float64 (gathered separately) to within fp32 rounding (relative
  2^-23; a bf16 reduction is off by up to 2^-8);
* activation-gradient collectives (tensor parallel's f / g, context parallel's all-to-all and
  ring, expert parallel's dispatch / combine) and ZeRO-3's parameter all-gathers run in the
  compute dtype and are only recorded;
* anything else fails the test, so a new gradient path must be classified here.

Layouts: tp2 + SP with ZeRO-1, tp2 with one kv head (replicated) and ZeRO-3, dp2 DDP, dp2 ZeRO-2,
ep2 MoE (expert data parallel), cp2 ring attention with DDP over dp_cp, and tp2 + SP with
``grad_reduce_dtype=bfloat16`` (the reductions then run in bf16: the setting is honoured both ways).
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from ndtrain.mesh import ParallelDims
from ndtrain.parallel import comm
from ndtrain.train.loop import IGNORE_INDEX, Trainer
from tests.dist_utils import run_ranks

_NDTRAIN = os.path.dirname(os.path.dirname(os.path.abspath(comm.__file__)))  # .../ndtrain
_COMM = os.path.abspath(comm.__file__)
_RECORDER = os.path.join(_NDTRAIN, "parallel", "flight_recorder.py")
_ACTIVATION_SITES = ("parallel/tp/collectives.py", "parallel/tp/sp_linear.py", "parallel/cp/",
                     "parallel/ep/collectives.py")  # sp_linear: the saved input re-gathered


def _site() -> str:
    """``path:qualname`` of the innermost ndtrain frame outside comm.py and the flight recorder that
    wraps every collective (relative to ndtrain/)."""
    f = sys._getframe(2)
    while f is not None:
        path = os.path.abspath(f.f_code.co_filename)
        if path.startswith(_NDTRAIN + os.sep) and path not in (_COMM, _RECORDER):
            return f"{os.path.relpath(path, _NDTRAIN)}:{f.f_code.co_qualname}"
        f = f.f_back
    return "?"


def _kind(site: str, op: str) -> str:
    """grad (weight-gradient reduction) | activation | param_gather | unknown."""
    path, _, name = site.partition(":")
    reduction = op in ("all_reduce", "reduce_scatter")
    if path.startswith(("parallel/dp/", "parallel/zero/")):
        return "grad" if reduction else ("param_gather" if path.startswith("parallel/zero/") else "unknown")
    if path == "parallel/tp/collectives.py" and name == "all_reduce_grad":
        return "grad"
    if path.startswith(_ACTIVATION_SITES):
        return "activation"
    return "unknown"


class Recorder:
    """Wraps the torch.distributed collectives while ``active``; see the module docstring."""

    def __init__(self):
        self.calls: list[dict] = []
        self.active = False
        self.orig = {"all_reduce": dist.all_reduce, "ag": comm._ALL_GATHER, "rs": comm._REDUCE_SCATTER,
                     "a2a": dist.all_to_all_single, "p2p": dist.batch_isend_irecv}
        dist.all_reduce = self._all_reduce
        comm._ALL_GATHER, comm._REDUCE_SCATTER = self._all_gather, self._reduce_scatter
        dist.all_to_all_single, dist.batch_isend_irecv = self._all_to_all, self._p2p

    def restore(self) -> None:
        dist.all_reduce, comm._ALL_GATHER, comm._REDUCE_SCATTER = (self.orig["all_reduce"], self.orig["ag"],
                                                                   self.orig["rs"])
        dist.all_to_all_single, dist.batch_isend_irecv = self.orig["a2a"], self.orig["p2p"]

    def _note(self, op: str, t: torch.Tensor) -> dict | None:
        if not self.active:
            return None
        site = _site()
        rec = {"op": op, "dtype": t.dtype, "numel": t.numel(), "site": site, "kind": _kind(site, op)}
        self.calls.append(rec)
        return rec

    def _sum64(self, t: torch.Tensor, group) -> torch.Tensor:
        """Sum over ``group`` of ``t`` taken in float64, gathered with the original all-gather."""
        n = dist.get_world_size(group)
        src = t.detach().double().reshape(-1).contiguous()
        buf = src.new_empty(n * src.numel())
        self.orig["ag"](buf, src, group=group)
        return buf.view(n, -1).sum(0)

    def _check(self, rec, out: torch.Tensor, ref: torch.Tensor, work) -> None:
        if work is not None:
            work.wait()  # the check needs the result now; a second wait() by the caller is a no-op
        err = (out.detach().double().reshape(-1) - ref).abs()
        rec["err"] = (err / (ref.abs() + 1e-30)).max().item() if ref.numel() else 0.0
        rec["within_fp32"] = bool((err <= 2.0**-23 * ref.abs() + 1e-38).all())

    def _all_reduce(self, t, op=dist.ReduceOp.SUM, group=None, async_op=False):
        rec = self._note("all_reduce", t)
        if rec is None or rec["kind"] != "grad":
            return self.orig["all_reduce"](t, op=op, group=group, async_op=async_op)
        assert op == dist.ReduceOp.SUM, rec
        ref = self._sum64(t, group)
        work = self.orig["all_reduce"](t, op=op, group=group, async_op=async_op)
        self._check(rec, t, ref, work)
        return work

    def _reduce_scatter(self, out, full, op=dist.ReduceOp.SUM, group=None, async_op=False):
        rec = self._note("reduce_scatter", full)
        if rec is None or rec["kind"] != "grad":
            return self.orig["rs"](out, full, op=op, group=group, async_op=async_op)
        r = dist.get_rank(group)
        ref = self._sum64(full, group)[r * out.numel():(r + 1) * out.numel()]
        work = self.orig["rs"](out, full, op=op, group=group, async_op=async_op)
        self._check(rec, out, ref, work)
        return work

    def _all_gather(self, out, shard, group=None, async_op=False):
        self._note("all_gather", shard)
        return self.orig["ag"](out, shard, group=group, async_op=async_op)

    def _all_to_all(self, out, inp, *args, **kwargs):
        self._note("all_to_all", inp)
        return self.orig["a2a"](out, inp, *args, **kwargs)

    def _p2p(self, ops):
        self._note("p2p", ops[0].tensor)
        return self.orig["p2p"](ops)


def _batch(vocab: int, t: int, b: int = 4):
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, vocab, (b, t), generator=g)
    y = torch.randint(0, vocab, (b, t), generator=g)
    y[torch.rand(b, t, generator=g) < 0.25] = IGNORE_INDEX
    return x, y


def _layouts(world: int) -> dict:
    from tests.parallel.layout_parity import tiny_cfg
    from tests.parallel.test_ep import moe_cfg

    def dense(**par):
        return tiny_cfg(world, **{"grad_reduce_dtype": "float32", **par})

    return {
        "tp2_sp_zero1": dense(tp=2, sequence_parallel=True, zero_stage=1),
        "tp2_kv1_zero3": tiny_cfg(world, n_kv_heads=1, tp=2, zero_stage=3),
        "dp2_ddp": dense(),
        "dp2_zero2": dense(zero_stage=2),
        "ep2_moe": moe_cfg(world, ep=2, micro=0),
        "cp2_ring": dense(cp=2, cp_impl="ring"),
        "tp2_sp_zero1_bf16": dense(tp=2, sequence_parallel=True, zero_stage=1, grad_reduce_dtype="bfloat16"),
    }


def _record(rank: int, world: int) -> dict:
    out = {}
    rec = Recorder()
    try:
        for name, cfg in _layouts(world).items():
            cfg.training.dtype = "bfloat16"
            cfg.training.grad_clip = 0.0
            mesh = ParallelDims.from_config(cfg.parallel, world).build_mesh()
            tr = Trainer(cfg, mesh, torch.device("cpu"))
            x, y = _batch(cfg.model.vocab_size, cfg.data.seq_len)
            dp = mesh.group("dp")
            n = x.shape[0] // dp.size
            inputs, labels, positions, _ = tr.plan.shard(x[dp.rank * n:(dp.rank + 1) * n],
                                                         y[dp.rank * n:(dp.rank + 1) * n])
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = tr.model(inputs, positions)
            loss = tr.plan.loss_sum(logits.float(), labels) / (y != IGNORE_INDEX).sum()
            rec.calls, rec.active = [], True
            loss.backward()
            tr.dp.finish_grad_sync()
            rec.active = False
            out[name] = rec.calls
    finally:
        rec.restore()
    return out


def test_every_weight_gradient_reduction_runs_in_grad_reduce_dtype():
    res = run_ranks(_record, 2, timeout_s=600)
    for calls in res:
        for name, recs in calls.items():
            unknown = [r for r in recs if r["kind"] == "unknown"]
            assert not unknown, (name, unknown)
            grads = [r for r in recs if r["kind"] == "grad"]
            assert grads, f"{name}: no gradient reduction recorded"
            want = torch.bfloat16 if name.endswith("_bf16") else torch.float32
            assert {r["dtype"] for r in grads} == {want}, (name, [(r["site"], r["dtype"]) for r in grads])
            if want == torch.float32:
                bad = [(r["site"], r["err"]) for r in grads if not r["within_fp32"]]
                assert not bad, (name, bad)
        tp_weight = {name: sum(r["site"].endswith(":all_reduce_grad") for r in recs)
                     for name, recs in calls.items()}
        # SP: 2 norm gains per block + the final norm (L = 2); one kv head: wk + wv per block.
        assert tp_weight["tp2_sp_zero1"] == 5 and tp_weight["tp2_sp_zero1_bf16"] == 5, tp_weight
        assert tp_weight["tp2_kv1_zero3"] == 4, tp_weight
        acts = {r["dtype"] for r in calls["tp2_sp_zero1"] if r["kind"] == "activation"}
        assert acts == {torch.bfloat16}, acts  # f / g on activations stay in the compute dtype
