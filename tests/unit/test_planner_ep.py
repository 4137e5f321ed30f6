"""The eager step-time model's expert-parallel parts (``planner.eager_axes_time``,
``planner.measure_ep``): the busiest-rank factor of recorded routing, by hand; the model charges
the EP layer as timed plus the wait for the busiest rank; the timing stand-in runs the EP module;
the routing replay records what the trainer routes. No timing assertions."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from ndtrain.calibration.eager_axes_time import collectives_per_microbatch, estimate_axes_step_time
from ndtrain.calibration.measure_ep import ep_moe_seconds, measure_ep_imbalance, rank_imbalance
from ndtrain.planner.model_spec import from_model_config
from tests.utils import tiny_config


def _ep_cfg(ep=2, layers=4):
    return tiny_config({"model.vocab_size": 260, "model.n_layers": layers, "model.ffn_hidden": 80,
                        "model.max_seq_len": 16, "model.rope_theta": 500000.0, "model.moe_experts": 4,
                        "model.moe_top_k": 2, "model.moe_ffn_hidden": 24, "data.seq_len": 16,
                        "training.dtype": "float32", "training.global_batch_size": 8, "training.micro_batch_size": 2,
                        "training.steps": 100, "training.lr": 1e-3, "training.warmup_steps": 10,
                        "training.grad_clip": 1.0, "parallel.bucket_size_bytes": 25 * 2**20},
                       parallel={"ep": ep, "dp_shard": 2})


def test_rank_imbalance_by_hand():
    """dp=2, ep=2, 2 microbatches per rank (single-process order: rank 0's j=0, 1, then rank 1's),
    experts {0, 1} on ep rank 0 and {2, 3} on rank 1. Layer 0 pairs microbatch j of rank 0 with
    microbatch j of rank 1 (not j + 1): all rows of j = 0 go to rank 0 and of j = 1 to rank 1, so
    both are 2x the mean; pairing them wrongly would give 1. Layer 1 is even; layer 2 routes
    nothing (counted as 1)."""
    c = torch.zeros(1, 4, 3, 4)
    c[0, 0, 0] = torch.tensor([200, 0, 0, 0])  # rank 0, j = 0
    c[0, 1, 0] = torch.tensor([0, 0, 200, 0])  # rank 0, j = 1
    c[0, 2, 0] = torch.tensor([0, 200, 0, 0])  # rank 1, j = 0
    c[0, 3, 0] = torch.tensor([0, 0, 0, 200])  # rank 1, j = 1
    c[0, :, 1] = torch.tensor([50, 50, 50, 50])
    assert rank_imbalance(c, ep=2, dp=2) == [pytest.approx((2 + 2 + 1 + 1 + 1 + 1) / 6)]
    c[0, 2, 1] = torch.tensor([100, 100, 0, 0])  # layer 1, j = 0: rank 0 gets 100 + 200, rank 1 100
    assert rank_imbalance(c, 2, 2) == [pytest.approx((2 + 2 + 1.5 + 1 + 1 + 1) / 6)]
    with pytest.raises(ValueError):
        rank_imbalance(torch.zeros(1, 4, 1, 6), ep=4, dp=4)


def test_ep_step_time_includes_the_layer_as_timed_and_the_busiest_rank():
    """Unit rates: a MoE block costs the dense components with ``moe_mlp_s`` in place of the SwiGLU;
    a routing skew f adds (f - 1) x ``moe_experts_s`` per MoE block and microbatch (the wait for the
    busiest rank) and (f - 1) x the mean bytes to each of the 4 token all-to-alls."""
    rates = {"gemm_flops_per_s": 1e30, "loss_s": 0.0, "optim_s_per_param": 0.0, "clip_s_per_param": 0.0,
             "accum_s_per_param": 0.0, "copy_s_per_param": 0.0}
    rates |= {f"{k}_s": 1.0 for k in ("attn", "norm", "rope", "swiglu", "residual")}
    rates |= {"moe_mlp_s": 50.0, "moe_experts_s": 20.0}
    cfg = _ep_cfg()
    spec = from_model_config(cfg.model)
    m, L, beta = 2, 4, 1e6  # 8 sequences / (2 per microbatch x dp 2)
    even = estimate_axes_step_time(spec, cfg, rates, 2, alpha=0.0, beta=beta)
    assert even["parts"]["blocks"] == pytest.approx(m * L * (7 - 1 + 50))
    assert even["parts"]["ep_imbalance"] == 0.0
    skew = estimate_axes_step_time(spec, cfg, rates | {"moe_imbalance": 1.75}, 2, alpha=0.0, beta=beta)
    assert skew["parts"]["ep_imbalance"] == pytest.approx(m * L * 0.75 * 20.0)
    n_ep = collectives_per_microbatch(spec, cfg, 0)["ep"]
    assert n_ep == 5 * L
    copies = 4 * 32 * 2 * 32 * 1 / 2  # fp32, 32 tokens x top-2 x dim 32, half of them leave the rank
    extra = m * 4 * L * 0.75 * copies / beta
    assert skew["parts"]["ep_comm"] - even["parts"]["ep_comm"] == pytest.approx(extra)
    assert skew["step_time_s"] - even["step_time_s"] == pytest.approx(m * L * 0.75 * 20.0 + extra)
    with pytest.raises(KeyError):  # a skew needs the local experts' time
        estimate_axes_step_time(spec, cfg, {k: v for k, v in rates.items() if k != "moe_experts_s"}
                                | {"moe_imbalance": 1.5}, 2)
    one = _ep_cfg(ep=1)  # no expert parallel: no wait for another rank, whatever the routing
    out = estimate_axes_step_time(spec, one, rates | {"moe_imbalance": 2.0}, 2, alpha=0.0, beta=beta)
    assert out["parts"]["ep_imbalance"] == 0.0


def test_ep_moe_seconds_runs_the_expert_parallel_module(monkeypatch):
    """The stand-in goes through ``ExpertParallelExperts`` (its count exchange and both token
    all-to-alls, as local copies) and its local experts see the k x N rows of the mean load."""
    from ndtrain.parallel.ep import layers

    seen = []
    real = layers.all_to_all_v

    def spy(out, inp, out_splits, in_splits, group, tally=None):
        seen.append((tuple(inp.shape), group.size, group.pg))
        return real(out, inp, out_splits, in_splits, group, tally)

    monkeypatch.setattr(layers, "all_to_all_v", spy)
    monkeypatch.setattr("ndtrain.parallel.ep.collectives.all_to_all_v", spy)
    cfg = _ep_cfg()
    out = ep_moe_seconds(dataclasses.asdict(cfg.model), 2, 2, 16, torch.float32, torch.Generator().manual_seed(0), 1)
    assert set(out) == {"moe_mlp_s", "moe_experts_s"} and all(v > 0 for v in out.values())
    rows = 2 * 2 * 16  # top-2 x 32 tokens
    assert ((2, 2), 2, None) in seen and ((rows, 32), 2, None) in seen  # counts, then the k N rows
    assert set(ep_moe_seconds(dataclasses.asdict(cfg.model), 1, 2, 16, torch.float32,
                              torch.Generator().manual_seed(0), 1)) == {"moe_mlp_s"}


def test_measure_ep_imbalance_replays_the_run(tmp_path):
    """Three steps of a tiny 2-layer MoE on a byte corpus, replayed in one process: a factor per
    step, each within [1, ep] (every microbatch routes rows); rejected layouts raise."""
    cfg = _ep_cfg(layers=2)
    (tmp_path / "corpus.txt").write_text("def f(x):\n    return x + 1\n" * 400)
    cfg.data.source, cfg.data.tokenizer, cfg.data.cache_dir = str(tmp_path / "corpus.txt"), "bytes", str(tmp_path)
    cfg.training.steps, cfg.training.eval_batches, cfg.training.sample_tokens = 3, 1, 0
    out = measure_ep_imbalance(cfg, 2, skip_first=1, timeout_s=240)
    assert len(out["per_step"]) == 3 and all(1.0 <= f <= 2.0 for f in out["per_step"])
    assert out["moe_imbalance"] == pytest.approx(sum(out["per_step"][1:]) / 2)
    with pytest.raises(ValueError):
        measure_ep_imbalance(_ep_cfg(ep=1), 2)
