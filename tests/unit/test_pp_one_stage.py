"""pp == 1 through ``StagePipeline``: one stage, microbatches forward then backward in order.

Reference: a plain gradient-accumulation loop (``_plain_step``, the trainer's loop before it had one
step path) on an identically built second ``Trainer``; ``Trainer.step`` now always runs the pipeline (same seed, same batches). Equality is bitwise (``==`` and
``torch.equal``, float64 and float32): the one-stage pipeline runs the same operations on the same
tensors in the same order (microbatch slices, logits cast to the parameter dtype, ``loss_sum / denom``
plus the extra-loss term, backward under ``dp.no_sync()`` for all but the last microbatch, loss
sums accumulated in float64), so not even rounding may differ. ``micro_batch_size`` (2) < local
batch (8): four microbatches. The MoE case (aux + z losses, MTP depth 1) exercises ``extra_loss``.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from ndtrain import mem_account
from ndtrain.config import Config
from ndtrain.mesh import AxisGroup, ParallelDims
from ndtrain.parallel import comm
from ndtrain.parallel.pp import observe
from ndtrain.parallel.pp.pipeline import StagePipeline
from ndtrain.parallel.pp.runtime import PipelineRuntime
from ndtrain.parallel.pp.schedules import Action
from ndtrain.train.loop import IGNORE_INDEX, Trainer
from tests.utils import tiny_config

V, T, G = 64, 8, 8


def _cfg(dtype: str, moe: bool) -> Config:
    extra = {"moe_experts": 4, "moe_top_k": 2, "moe_aux_loss_coef": 0.01, "moe_z_loss_coef": 0.001,
             "mtp_depth": 1} if moe else {}
    return tiny_config({"model.vocab_size": V, "model.max_seq_len": 32, "data.seq_len": T, "training.steps": 3,
                        "training.dtype": dtype, "training.global_batch_size": G, "training.micro_batch_size": 2,
                        "training.lr": 1e-3, "training.warmup_steps": 1,
                        "parallel.bucket_size_bytes": 25 * 2**20}, model=extra)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    inputs, labels = torch.randint(0, V, (G, T), generator=g), torch.randint(0, V, (G, T), generator=g)
    keep = torch.rand(G, T, generator=g) < torch.linspace(0.2, 1.0, G)[:, None]
    return inputs, labels.masked_fill(~keep, IGNORE_INDEX)


def _plain_step(tr: Trainer, inputs, labels) -> dict:
    """The slow twin: a plain gradient-accumulation loop over the trainer's own model, gradient
    synchroniser and optimizer (what ``Trainer.step`` ran before it had one step path)."""
    n_valid = comm.all_reduce_scalar(float((labels != IGNORE_INDEX).sum()), tr.mesh.group("dp_cp"))
    denom = max(n_valid, 1.0)
    if tr.extras is not None:
        tr.extras.begin_step(inputs, labels)
    mb, loss_sum = tr.micro_batch, torch.zeros((), dtype=torch.float64)
    n_micro = -(-inputs.shape[0] // mb)
    for i in range(n_micro):
        sl = slice(i * mb, (i + 1) * mb)
        with contextlib.nullcontext() if i == n_micro - 1 else tr.dp.no_sync():
            logits = tr.model(inputs[sl], None).to(tr.param_dtype)
            ls = tr.plan.loss_sum(logits, labels[sl])
            loss = ls / denom
            if tr.extras is not None:
                loss = loss + tr.extras.micro_loss(labels[sl])
            loss.backward()
        loss_sum += ls.detach().double()
    tr.dp.finish_grad_sync()
    grad_norm = tr.dp.clip_grad_norm(tr.cfg.training.grad_clip, tr.mesh)
    tr.optimizer.step()
    tr.scheduler.step()
    tr.optimizer.zero_grad(set_to_none=True)
    out = {"loss": loss_sum.item() / denom, "grad_norm": grad_norm}
    if tr.extras is not None:
        out.update(tr.extras.end_step())
    return out


@pytest.mark.parametrize("dtype,moe", [("float64", False), ("float32", False), ("float32", True)])
def test_one_stage_pipeline_equals_plain_loop_bitwise(dtype, moe):
    cfg = _cfg(dtype, moe)
    mesh = ParallelDims(world_size=1).build_mesh()
    plain, piped = Trainer(cfg, mesh, torch.device("cpu")), Trainer(cfg, mesh, torch.device("cpu"))
    assert isinstance(piped.pipeline, StagePipeline) and piped.micro_batch < piped.local_batch
    assert piped.pipeline.runtime.schedule(4).actions == [[a for j in range(4) for a in
                                                           (Action("F", j), Action("B", j))]]
    for step in range(3):
        want, got = _plain_step(plain, *_batch(step)), piped.step(*_batch(step))
        for key in ("loss", "grad_norm") + (("aux_loss", "mtp_loss") if moe else ()):
            assert got[key] == want[key], (step, key, got[key], want[key])
        for (n, a), b in zip(plain.model.named_parameters(), piped.model.parameters()):
            assert torch.equal(a, b), (step, n)


def test_observers_meter_only_when_attached(monkeypatch):
    """With no observer the runtime neither times, sleeps nor meters; ``track_memory`` attaches the
    activation meter, and ``peak_activation_bytes`` reads it (the trainer's former flags)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11)).double()
    x = torch.randint(0, 11, (4, 5))

    def loss_fn(logits, y):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")

    rt = PipelineRuntime([net], AxisGroup("pp", 1, 0, None), "1f1b", loss_fn)

    def boom(*_a, **_k):
        raise AssertionError("instrumentation ran without an observer")

    with monkeypatch.context() as mp:
        for fn in ("time", "sleep"):
            mp.setattr(observe.time, fn, boom)
        mp.setattr(mem_account.ActivationMeter, "__enter__", boom)
        rt.run(x, x, m=2)
    assert rt.peak_activation_bytes == 0 and not rt.track_memory
    rt.track_memory = True
    timer = observe.ActionTimer()
    rt.observers.append(timer)
    rt.run(x, x, m=2)
    # at least the two microbatches' (2, 5, 11) float64 logits were alive during the step
    assert rt.peak_activation_bytes >= 2 * 5 * 11 * 8
    assert [(e.kind, e.mb) for e in timer.events] == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    assert all(e.end >= e.start for e in timer.events) and timer.wait_s >= 0.0
    rt.track_memory = False
    assert not rt.track_memory and rt.observers == [timer]


def test_gil_switch_interval_is_set_for_pipelines_only_and_restored():
    """``_switch_interval`` shortens Python's GIL switch interval and restores the caller's value, also
    when the body raises; a one-stage runtime (no receiver threads) leaves it as it is."""
    import sys

    from ndtrain.parallel.pp import runtime as rt_mod

    before = sys.getswitchinterval()
    assert before > rt_mod.SWITCH_INTERVAL_S  # Python's default 5 ms
    with rt_mod._switch_interval(rt_mod.SWITCH_INTERVAL_S):
        assert sys.getswitchinterval() == pytest.approx(rt_mod.SWITCH_INTERVAL_S)
    assert sys.getswitchinterval() == before
    with pytest.raises(RuntimeError, match="boom"), rt_mod._switch_interval(rt_mod.SWITCH_INTERVAL_S):
        raise RuntimeError("boom")
    assert sys.getswitchinterval() == before

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11)).double()
    x = torch.randint(0, 11, (4, 5))
    seen = []
    net.register_forward_hook(lambda *_: seen.append(sys.getswitchinterval()))

    def loss_fn(logits, y):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")

    PipelineRuntime([net], AxisGroup("pp", 1, 0, None), "1f1b", loss_fn).run(x, x, m=2)
    assert seen == [before] * 2 and sys.getswitchinterval() == before
