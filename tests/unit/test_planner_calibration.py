"""The planner's eager memory model against the trainer's own meters, on deterministic tiny runs.

Reference: ``ndtrain.mem_account`` (``StateMemory``: bytes of the distinct storages of params /
grads / optimizer state at the trainer's sample points; ``ActivationMeter``: peak of live storages
created by operators during one microbatch's forward + backward). Both are deterministic counts
of tensor bytes, so:

* model state (``estimate_trainer_state_bytes``) must match exactly, byte for byte, for DDP,
  ZeRO-1/2/3 and HSDP, fp32 and bf16 (dim-0 padding, 4-byte AdamW step counters, ZeRO-2's bucket
  of full gradients in the hooks included);
* activations (``estimate_eager_activation_peak``) within 1%: the model leaves out the loss's
  scalars (tens of bytes) and, under bf16 / fp64, a few hundred bytes of casts around RoPE; the
  derivation is exact otherwise, so 1% (not the issue's 15%) would catch any missing tensor.

The step-time model is checked for its arithmetic only (no timing assertions in tests).
"""
from __future__ import annotations

import math

import pytest
import torch

from ndtrain.calibration.calibrate import compare_with_runs, predict_memory
from ndtrain.calibration.eager_time import eager_comm_seconds, eager_gemm_flops, estimate_eager_step_time
from ndtrain.config import ParallelConfig
from ndtrain.mesh import ParallelDims
from ndtrain.parallel import flight_recorder
from ndtrain.planner.eager import (
    estimate_eager_activation_peak,
    estimate_trainer_state_bytes,
    padded_shard_numel,
    param_shapes,
)
from ndtrain.planner.model_spec import from_model_config
from ndtrain.train.loop import Trainer
from tests.dist_utils import run_ranks
from tests.utils import tiny_config


def _cfg(dtype="float32", ac="none", tie=False, zero=0, mb=2, world=1, bucket=25 * 2**20, rep=1, **model):
    m = {"vocab_size": 96, "ffn_hidden": 80, "max_seq_len": 16, "tie_embeddings": tie, **model}
    return tiny_config({"data.seq_len": m["max_seq_len"], "training.dtype": dtype,
                        "training.global_batch_size": 2 * mb * world, "training.micro_batch_size": mb,
                        "training.activation_checkpoint": ac, "training.steps": 100, "training.lr": 1e-3,
                        "training.warmup_steps": 10, "training.grad_clip": 1.0}, model=m,
                       parallel={"zero_stage": zero, "bucket_size_bytes": bucket, "dp_replicate": rep,
                                 "dp_shard": world // rep})


def _metered(cfg, rank=0, world=1) -> dict:
    """Two metered steps of this rank's share of a fixed batch; the second step's report."""
    tr = Trainer(cfg, ParallelDims.from_config(cfg.parallel, world).build_mesh(), torch.device("cpu"))
    b, T = cfg.training.global_batch_size, cfg.data.seq_len
    x = torch.randint(0, cfg.model.vocab_size, (b, T + 1), generator=torch.Generator().manual_seed(0))
    loc = slice(rank * b // world, (rank + 1) * b // world)
    for _ in range(2):
        tr.measure_memory = True
        out = tr.step(x[loc, :-1], x[loc, 1:])
    return {k: v for k, v in out.items() if k.startswith("mem_")}


def _check(cfg, meas, world=1):
    spec, p, t = from_model_config(cfg.model), cfg.parallel, cfg.training
    n_micro = t.global_batch_size // world // t.micro_batch_size
    st = estimate_trainer_state_bytes(spec, p.zero_stage, world // p.dp_replicate, t.dtype,
                                      p.bucket_size_bytes, True, n_micro)
    for k in ("params", "grads", "optim"):
        assert st[k] == meas[f"mem_{k}_bytes"], (k, st[k], meas)
    assert st["total"] == meas["mem_state_peak_bytes"]
    act = estimate_eager_activation_peak(spec, t.micro_batch_size, cfg.data.seq_len, t.dtype,
                                         t.activation_checkpoint, p.zero_stage)
    assert act["peak"] == pytest.approx(meas["mem_activations_peak_bytes"], rel=0.01), (act, meas)


CASES = [  # which peak each exercises: head (log-softmax / output backward), top block, embedding
    {},
    {"ac": "full"},
    {"ac": "full", "tie": True, "n_layers": 3, "ffn_hidden": 32, "vocab_size": 64},  # tied grad waits: block peak
    {"tie": True, "vocab_size": 256, "n_layers": 1, "ffn_hidden": 32, "mb": 1},  # tied embedding backward
    {"dtype": "float64", "ac": "full"},
    {"dtype": "bfloat16"},
    {"dtype": "bfloat16", "ac": "full", "ffn_hidden": 160, "vocab_size": 64, "max_seq_len": 32},
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "fp32")
def test_single_process_state_exact_and_activations_within_1pct(case):
    cfg = _cfg(**case)
    _check(cfg, _metered(cfg))


def _zero_ranks(rank, world, cases):
    return [_metered(_cfg(**c, world=world), rank, world) for c in cases]


ZERO_CASES = [{"zero": 0}, {"zero": 1}, {"zero": 2, "bucket": 4096}, {"zero": 2}, {"zero": 3},
              {"zero": 3, "rep": 2}, {"zero": 1, "dtype": "bfloat16"}, {"zero": 2, "dtype": "bfloat16", "bucket": 4096},
              {"zero": 3, "dtype": "bfloat16"}, {"zero": 0, "dtype": "bfloat16", "ac": "full"}]


def test_two_ranks_ddp_zero_hsdp_state_exact_and_activations_within_1pct():
    """One 2-rank gloo group runs every case; both ranks are checked (their shards hold different
    valid rows but the same padded sizes)."""
    results = run_ranks(_zero_ranks, 2, ZERO_CASES, timeout_s=240)
    for rank_res in results:
        for case, meas in zip(ZERO_CASES, rank_res):
            _check(_cfg(**case, world=2), meas, world=2)


def test_param_shapes_match_the_model_and_padding():
    cfg = _cfg(tie=False, vocab_size=97, ffn_hidden=81)
    from ndtrain.model import build_model

    model = build_model(cfg.model, "cpu", torch.float32, 0)
    spec = from_model_config(cfg.model)
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == param_shapes(spec)
    assert sum(math.prod(s) for _, s in param_shapes(spec)) == spec.params_total
    # vocab 97 and ffn 81 rows do not divide by 2: one padding row each (97 -> 2 x 49, 81 -> 2 x 41)
    shapes = [s for _, s in param_shapes(spec)]
    assert padded_shard_numel(shapes, 2) * 2 - spec.params_total == (2 + 2 * 2) * 32


def test_compare_with_runs_on_a_real_run(tmp_path):
    """A 3-step ``run()`` on a byte-tokenized corpus: the metered sum is predicted within 1%, RSS
    with the given baseline is reported, step time from given rates is the model's arithmetic."""
    from ndtrain.data import prepare_data
    from ndtrain.train.loop import run

    (tmp_path / "corpus.txt").write_text("def f(x):\n    return x + 1\n" * 400)
    cfg = _cfg()
    cfg.data.source, cfg.data.tokenizer, cfg.data.cache_dir = str(tmp_path / "corpus.txt"), "bytes", str(tmp_path)
    cfg.model.vocab_size = 260
    cfg.training.steps, cfg.training.eval_batches, cfg.training.sample_tokens = 3, 1, 0
    cfg.logging.log_every, cfg.logging.plot, cfg.checkpoint.every = 1, False, 0
    run(cfg, tmp_path / "run", prepare_data(cfg.data, cfg.model.vocab_size))
    rates = {"gemm_flops_per_s": 1e10, "optim_s_per_param": 1e-9, "clip_s_per_param": 1e-9,
             "accum_s_per_param": 1e-9, "copy_s_per_param": 1e-9, "loss_s": 1e-4}
    rates |= {f"{k}{s}": 1e-4 for k in ("attn", "norm", "rope", "swiglu", "residual") for s in ("_s", "_fwd_s")}
    rows = compare_with_runs([tmp_path / "run"], 1, 300 * 2**20, skip_first=1, rates=rates)
    r = rows[0]
    assert abs(r["metered_rel_err"]) < 0.01
    pred = predict_memory(cfg, 1, 300 * 2**20)
    assert r["predicted_mem_bytes"] == pred["rss"] == 300 * 2**20 + pred["live"]
    spec = from_model_config(cfg.model)
    want = 2 * (eager_gemm_flops(spec, 32) / 1e10 + 2 * (1e-4 * 7) + 2e-4) \
        + 1e-9 * (3 * spec.params_total)  # 2 microbatches; optim + clip + 1 accumulation pass
    assert r["predicted_step_s"] == pytest.approx(want, rel=1e-9)


def test_step_time_model_arithmetic():
    spec = from_model_config(_cfg().model)
    h, f, V, L, q, k = 32, 80, 96, 2, 32, 16
    n_mm = L * (h * q + 2 * h * k + q * h + 3 * h * f) + h * V
    assert eager_gemm_flops(spec, 32) == 6 * 32 * n_mm
    assert eager_gemm_flops(spec, 32, "full") == 6 * 32 * n_mm + 2 * 32 * (n_mm - h * V)
    psi, e = spec.params_total, 4
    # DDP over 2 ranks: one ring all-reduce of every fp32 gradient, one bucket
    t = eager_comm_seconds(spec, 0, 2, 1, 2, alpha_s=1e-4, beta_bytes_per_s=1e9)
    assert t == pytest.approx(2 * 1 / 2 * e * psi / 1e9 + 2 * 1e-4)
    # ZeRO-3 over 2 ranks, 2 microbatches: (gather, gather, reduce-scatter) per microbatch per unit
    S = padded_shard_numel([s for _, s in param_shapes(spec)], 2)
    t3 = eager_comm_seconds(spec, 3, 2, 1, 2, alpha_s=1e-4, beta_bytes_per_s=1e9)
    assert t3 == pytest.approx(6 * S * e / 1e9 + 6 * (L + 2) * 1e-4)
    with pytest.raises(ValueError):
        estimate_eager_step_time(spec, 2, 16, 2, {}, policy="selective")


def test_eager_knob_of_the_per_layer_model_is_one_measured_layer():
    """``memory.estimate_activation_bytes_per_layer(implementation="eager")`` is what one more block
    adds to the metered activation peak (fp32, the peak at the head in both runs); the fused
    (Korthikanti, bf16) figure is far below, which is why the CPU calibration needs the eager one."""
    from ndtrain.planner.memory import estimate_activation_bytes_per_layer

    one, two = (_metered(_cfg(n_layers=n))["mem_activations_peak_bytes"] for n in (1, 2))
    spec = from_model_config(_cfg().model)
    eager = estimate_activation_bytes_per_layer(spec, 32, 16, act_bytes=4, implementation="eager")
    assert eager["total"] == two - one
    fused = estimate_activation_bytes_per_layer(spec, 32, 16, act_bytes=4)
    assert fused["total"] < 0.8 * eager["total"]
    with pytest.raises(ValueError):
        estimate_activation_bytes_per_layer(spec, 32, 16, tp=2, implementation="eager")


# ---- TP / CP / PP / EP layouts (planner.eager_axes): state exact, activations within 10% ----------

AXES_CASES = {  # 2 ranks each; 4 layers so that pp=2 with v=2 has a block per chunk
    "tp2": {"tp": 2, "dp_shard": 1},
    "cp2": {"cp": 2, "dp_shard": 1},
    "ep2": {"ep": 2, "dp_shard": 2},  # with the 4-expert top-2 MoE model of _axes_cfg
    "pp2_zero_bubble": {"pp": 2, "dp_shard": 1, "pp_schedule": "zero_bubble"},
}


def _axes_cfg(par):
    moe = {"moe_experts": 4, "moe_top_k": 2} if par.get("ep", 1) > 1 else {}
    cfg = _cfg(mb=2, n_layers=4, **moe)
    cfg.training.global_batch_size = 8
    cfg.parallel = ParallelConfig(**par)
    return cfg


def _axes_ranks(rank, world, cases):
    out = []
    for par in cases:
        cfg = _axes_cfg(par)
        tr = Trainer(cfg, ParallelDims.from_config(cfg.parallel, world).build_mesh(), torch.device("cpu"))
        x = torch.randint(0, cfg.model.vocab_size, (8, 17), generator=torch.Generator().manual_seed(0))
        dp = cfg.parallel.dp_shard
        x = x[rank * 8 // dp:(rank + 1) * 8 // dp] if dp > 1 else x  # this data-parallel rank's rows
        for _ in range(2):
            tr.measure_memory = True
            seq0 = flight_recorder.recorder().seq
            res = tr.step(x[:, :-1], x[:, 1:])
        new = list(flight_recorder.recorder().entries)[-(flight_recorder.recorder().seq - seq0):]
        counts = {a: sum(1 for e in new if e["axis"] == a) for a in ("tp", "cp", "ep")}
        out.append({k: v for k, v in res.items() if k.startswith("mem_")} | {"collectives": counts})
    return out


def test_tp_cp_ep_pp_layouts_state_exact_activations_within_10pct():
    """One 2-rank gloo group runs TP2, CP2 (ring), EP2 (a 4-expert top-2 MoE) and PP2 under ZB-H1 (the schedule replay with split backward,
    which keeps each microbatch's activations and output gradients until its W pass; 1F1B / GPipe /
    interleaved are the same replay without W, checked by the bench). Both ranks (both pipeline
    stages) are checked. The state model is exact (the rank's parameter shards x 4 fp32 copies + 4
    bytes per tensor); the activation model replays the trainer's schedule with estimated per-chunk
    bytes (seen: -9% to +9%), so 10% is its bound here and 15% (the issue's) on the metered sum."""
    from ndtrain.calibration.eager_axes import estimate_axes_activation_peak, estimate_axes_state_bytes
    from ndtrain.calibration.eager_axes_time import collectives_per_step

    results = run_ranks(_axes_ranks, 2, list(AXES_CASES.values()), timeout_s=240)
    for rank, per_case in enumerate(results):
        for (name, par), meas in zip(AXES_CASES.items(), per_case):
            cfg = _axes_cfg(par)
            spec, r = from_model_config(cfg.model), rank if par.get("pp", 1) > 1 else 0
            # the step-time model charges what the trainer's flight recorder saw in one step
            m = 8 // (cfg.training.micro_batch_size * par.get("dp_shard", 1))
            want = collectives_per_step(spec, cfg, r, m)
            assert meas["collectives"] == {a: want[a] for a in ("tp", "cp", "ep")}, (name, meas, want)
            st = estimate_axes_state_bytes(spec, cfg, r)
            assert st["total"] == meas["mem_state_peak_bytes"], (name, rank, st, meas)
            act = estimate_axes_activation_peak(spec, cfg, r)["peak"]
            assert act == pytest.approx(meas["mem_activations_peak_bytes"], rel=0.10), (name, rank, act, meas)
    # the replay is what tells the schedules apart: 1F1B's replay on the same stage keeps far less
    cfg = _axes_cfg({"pp": 2, "dp_shard": 1, "pp_schedule": "1f1b"})
    one_f_one_b = estimate_axes_activation_peak(from_model_config(cfg.model), cfg, 0)["peak"]
    assert results[0][-1]["mem_activations_peak_bytes"] > 1.3 * one_f_one_b


def test_axes_step_time_model_arithmetic():
    """``estimate_axes_step_time`` adds what its docstring lists: with unit rates every part is a
    count (FLOPs, components, collectives) that this test recomputes by hand."""
    from ndtrain.calibration.eager_axes_time import axis_collective_gap, estimate_axes_step_time

    rates = {"gemm_flops_per_s": 1.0, "loss_s": 1.0, "optim_s_per_param": 0.0, "clip_s_per_param": 0.0,
             "accum_s_per_param": 0.0, "copy_s_per_param": 0.0}
    rates |= {f"{k}_s": 1.0 for k in ("attn", "norm", "rope", "swiglu", "residual")}
    tp_rates = rates | {"tp_region_s": 10.0, "tp_loss_s": 100.0, "tp_embed_s": 1000.0}
    cfg = _axes_cfg({"tp": 2, "dp_shard": 1})
    spec = from_model_config(cfg.model)
    with pytest.raises(KeyError):  # TP's own layers are part of the model: no TP estimate without them
        estimate_axes_step_time(spec, cfg, rates, 2, alpha=1.0, beta=1e30)
    out = estimate_axes_step_time(spec, cfg, tp_rates, 2, alpha=1.0, beta=1e30)
    h, q, k, f, V, L, s = 32, 16, 8, 40, 48, 4, 32  # one TP rank's widths; 2 x 16 tokens
    n_mm = L * (h * q + 2 * h * k + q * h + 3 * h * f) + h * V
    assert out["parts"]["gemm"] == pytest.approx(4 * 6 * s * n_mm)  # 4 microbatches
    # attn + 2 norms + rope + swiglu + 2 adds, + f and g of the block's two regions
    assert out["parts"]["blocks"] == pytest.approx(4 * L * (7 + 2 * 10))
    # the final norm, the vocabulary-parallel loss (not the single-device one) and embedding
    assert out["parts"]["head"] == pytest.approx(4 * (1 + 100 + 1000))
    # 4 per block, the embedding's, the head input gradient's, the vocab-parallel loss's two; 2 alphas each
    n_tp = 4 * (4 * L + 4)
    assert out["parts"]["tp_comm"] == pytest.approx((n_tp + 1) * 2)  # + the clip's norm
    # measured per-collective cost at the layout's gap replaces the alpha-beta charge
    where = axis_collective_gap(spec, cfg, tp_rates | {"tp_collective_s": 7.0}, "tp")
    compute = 6 * s * n_mm + L * (7 + 20) + 1 + 100 + 1000  # one microbatch, nothing of the comm
    assert where == {"gap_s": pytest.approx(compute / (4 * L + 4)), "nbytes": 4 * s * 32}
    out2 = estimate_axes_step_time(spec, cfg, tp_rates | {"tp_collective_s": 0.5}, 2, alpha=1.0, beta=1e30)
    assert out2["parts"]["tp_comm"] == pytest.approx(n_tp * 0.5 + 2)
    assert out2["step_time_s"] - out["step_time_s"] == pytest.approx(n_tp * (0.5 - 2))
    cp = _axes_cfg({"cp": 2, "dp_shard": 1})  # the ring's own attention replaces the fused kernel's
    with pytest.raises(ValueError):
        axis_collective_gap(spec, cp, rates, "tp")
    out = estimate_axes_step_time(spec, cp, rates | {"ring_attn_s": 10.0}, 2, alpha=1.0, beta=1e30)
    assert out["parts"]["blocks"] == pytest.approx(4 * L * (10 + 6))
    assert out["parts"]["cp_comm"] == pytest.approx(4 * L * 4)  # 1 + 1 K/V and 2 dK/dV exchanges
    # one K / V block of a rank's 16 tokens (1 kv head of 8); 4 L exchanges per microbatch
    cp_spec = from_model_config(cp.model)
    kv = 2 * 4 * 16 * cp_spec.n_kv_heads * cp_spec.head_dim
    assert axis_collective_gap(spec, cp, rates | {"ring_attn_s": 10.0}, "cp")["nbytes"] == kv
    out2 = estimate_axes_step_time(spec, cp, rates | {"ring_attn_s": 10.0, "cp_collective_s": 3.0}, 2, 1.0, 1e30)
    assert out2["parts"]["cp_comm"] == pytest.approx(4 * L * 4 * 3.0)
    with pytest.raises(KeyError):
        estimate_axes_step_time(spec, cp, rates, 2)
    pp = _axes_cfg({"pp": 2, "dp_shard": 1})
    out = estimate_axes_step_time(spec, pp, rates, 2, alpha=0.0, beta=1e30)
    assert out["parts"]["bubble"] == pytest.approx(sum(v for k, v in out["parts"].items()
                                                       if k not in ("bubble", "param_passes", "dp_comm")) / 4)


def test_tp_components_are_the_tp_layers_own_work():
    """``measure_eager._tp_components`` times the TP layers' code with the collectives off: the
    region's f / g copy the activation (forward output is a new tensor, the input gradient too),
    and the vocabulary-parallel loss equals the single-device cross entropy over the rank's logits
    when every label is local (the oracle, float64, 1e-6)."""
    from ndtrain.calibration.measure_eager import _tp_components

    g = torch.Generator().manual_seed(0)

    def rnd(*shape, grad=True):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_(grad)

    comps = _tp_components(2, 2, 8, 16, 24, rnd)
    assert set(comps) == {"tp_region", "tp_loss", "tp_embed"}
    fn, (x,) = comps["tp_region"](0)
    y = fn(x)
    y.backward(torch.full_like(y, 3.0))
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr() and torch.equal(x.grad, torch.full_like(x, 3.0))
    fn, (z,) = comps["tp_loss"](0)
    loss = fn(z)
    from ndtrain.mesh import AxisGroup
    from ndtrain.parallel.tp.vocab_loss import vocab_parallel_cross_entropy

    labels = torch.randint(0, 24, (16,), generator=g)
    got = vocab_parallel_cross_entropy(z, labels, AxisGroup("tp", 2, 0, None), 48).sum()
    ref = torch.nn.functional.cross_entropy(z, labels, reduction="sum")
    assert got.item() == pytest.approx(ref.item(), rel=1e-6) and loss.ndim == 0
    fn, (w,) = comps["tp_embed"](0)
    out = fn(w)
    assert out.shape == (2, 8, 16)
    out.sum().backward()
    assert w.grad is not None and w.grad.shape == (24, 16)
