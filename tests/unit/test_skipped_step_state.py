"""A skipped step leaves every state unchanged: the aux-loss-free expert bias included.

One process, an MoE model with MTP (4 experts, top-2, bias rate 1e-2). Two ways to skip, each at
step 2 of 3: a non-finite loss (``Trainer.nan_steps``: a bad step) in float64, and a gradient
overflow under fp16 loss scaling (an ``inf`` written into a gradient after the sync). On the
skipped step the expert biases, the weights, the AdamW state and the schedule position are
bitwise unchanged (``torch.equal``); steps 1 and 3 move the biases (by +-rate per expert) and the
weights. Before the fix the bias moved by the full rate on the skipped step.
"""
from __future__ import annotations

import pytest
import torch

from ndtrain.config import Config, DataConfig, ModelConfig, TrainingConfig
from ndtrain.mesh import ParallelDims
from ndtrain.model import moe_balance
from ndtrain.train.trainer import Trainer

V, T, G, RATE = 64, 8, 4, 1e-2


def _trainer(dtype: str) -> Trainer:
    cfg = Config(model=ModelConfig(vocab_size=V, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48,
                                   max_seq_len=32, rope_theta=10000.0, moe_experts=4, moe_top_k=2,
                                   moe_aux_loss_coef=0.01, moe_bias_update_rate=RATE, mtp_depth=1),
                 data=DataConfig(seq_len=T),
                 training=TrainingConfig(steps=3, dtype=dtype, global_batch_size=G, lr=1e-3, warmup_steps=1,
                                         grad_clip=1.0, loss_scale_init=1024.0))
    return Trainer(cfg, ParallelDims(world_size=1).build_mesh(), torch.device("cpu"))


def _state(tr: Trainer) -> dict:
    return {"bias": [m.expert_bias.clone() for m in moe_balance.moe_layers(tr.model)],
            "weights": [p.detach().clone() for p in tr.model.parameters()],
            "optim": [{k: v.clone() for k, v in st.items()} for st in tr.optimizer.state.values()],
            "sched": tr.scheduler.last_epoch}


def _same(a: dict, b: dict, key: str) -> bool:
    if key == "sched":
        return a[key] == b[key]
    if key == "optim":
        return len(a[key]) == len(b[key]) and all(torch.equal(x[k], y[k]) for x, y in zip(a[key], b[key])
                                                  for k in x)
    return all(torch.equal(x, y) for x, y in zip(a[key], b[key]))


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, V, (G, T), generator=g), torch.randint(0, V, (G, T), generator=g)


@pytest.mark.parametrize("how", ["nan_loss", "fp16_overflow"])
def test_a_skipped_step_leaves_the_expert_bias_and_all_state_unchanged(how):
    tr = _trainer("float64" if how == "nan_loss" else "float16")
    if how == "nan_loss":
        tr.nan_steps = frozenset({2})
    else:
        sync = tr.dp.finish_grad_sync

        def overflow():
            sync()
            if tr.step_count == 1:  # during step 2
                next(p.grad for p in tr.model.parameters() if p.grad is not None).view(-1)[0] = float("inf")

        tr.dp.finish_grad_sync = overflow
    for step in (1, 2, 3):
        before = _state(tr)
        out = tr.step(*_batch(step))
        after = _state(tr)
        skipped = out["bad_step"] if how == "nan_loss" else out["skipped"]
        assert skipped == (step == 2), (step, out)
        if step == 2:
            for key in ("bias", "weights", "optim", "sched"):
                assert _same(before, after, key), (how, key)
        else:
            assert not _same(before, after, "weights") and not _same(before, after, "sched")
            for b0, b1 in zip(before["bias"], after["bias"]):  # every expert moved by +-rate (or 0)
                step_size = (b1 - b0).abs()
                assert step_size.max() > 0, (how, step)
                assert torch.all((step_size == 0) | ((step_size - RATE).abs() < 1e-6)), step_size
