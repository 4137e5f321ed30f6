"""Measure mode (matmul peak, gloo all-reduce alpha / beta) and the comparison with real runs."""
import json

import pytest
import yaml

from ndtrain.calibration.calibrate import compare_with_runs, format_comparison
from ndtrain.calibration.measure import (
    fit_alpha_beta,
    format_measurements,
    measure_matmul_flops,
    measure_sync_latency,
    measured_accelerator,
)
from ndtrain.config import Config
from tests.dist_utils import run_ranks


def test_fit_alpha_beta_recovers_the_ring_model():
    n, alpha, beta = 4, 25e-6, 3e9
    sizes = [2**k for k in range(10, 24, 2)]
    samples = [(v, 2 * (n - 1) * alpha + 2 * (n - 1) / n * v / beta) for v in sizes]
    a, b = fit_alpha_beta(samples, n)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(beta, rel=1e-6)
    with pytest.raises(ValueError):
        fit_alpha_beta([(1024, 1e-3), (1024, 2e-3)], 2)
    with pytest.raises(ValueError, match="do not grow"):  # noise: never an infinite bandwidth
        fit_alpha_beta([(1024, 2e-3), (2**20, 1e-3)], 2)


def test_matmul_measurement_and_measured_accelerator():
    mm = measure_matmul_flops(sizes=(64, 128), seconds=0.02, device="cpu")
    assert mm["peak"] > 1e6 and set(mm["per_size"]) == {64, 128} and mm["device"] == "cpu"
    comm = {"backend": "gloo", "world": 2, "samples": [(4096, 1e-4), (2**20, 1e-3)], "alpha_s": 5e-5,
            "beta_bytes_per_s": 1.5e9}
    acc = measured_accelerator(mm, comm)
    assert acc.name == "cpu" and acc.peak("float32") == mm["peak"]
    assert acc.intra_node_bytes_per_s == 1.5e9 and acc.intra_node_latency_s == 5e-5
    assert "GFLOP/s" in format_measurements(mm, comm) and "alpha" in format_measurements(mm, comm)


def _gloo_both(rank, world):
    from ndtrain.planner import measure

    return (measure._collective_worker(rank, world, [2**12, 2**21, 2**23], 5, "gloo"),
            measure._sync_worker(rank, world, 4096, 128, 20, 3),
            measure._sync_worker(rank, world, 2**16, 128, 10, 2, gap_s=0.004))


@pytest.mark.slow
def test_gloo_allreduce_and_sync_latency_measurement():
    """One 2-process gloo group (a few seconds, mostly the torch imports) runs both measurements'
    workers: the all-reduce times fit the ring model (sizes far apart, so the bandwidth term
    dominates scheduling noise), and an all-reduce between computing ranks costs something
    positive and below the scale of the loop (``measure_sync_latency``'s quantity)."""
    per_rank = run_ranks(_gloo_both, 2)
    samples = per_rank[0][0]
    alpha, beta = fit_alpha_beta(samples, 2)
    assert len(samples) == 3 and 1e7 < beta < 1e12 and alpha >= 0
    sync = max(r[1] for r in per_rank)
    assert 0 < sync < 0.05
    # with gap_s the loop computes about that long between collectives (the same count on each
    # rank), and each all-reduce's wait is timed: positive, below the scale of the loop
    assert all(0.002 < r[2][1] < 0.04 and 0 < r[2][0] < 0.05 for r in per_rank)


def test_sync_latency_wrapper(monkeypatch):
    """``measure_sync_latency``: the per-collective cost is the slowest rank's; alpha its share per
    ring step (2 (n - 1) of them)."""
    import ndtrain.spawn

    monkeypatch.setattr(ndtrain.spawn, "spawn", lambda fn, world, args, **kw: [1e-3, 3e-3, 2e-3][:world])
    res = measure_sync_latency(world=3)
    assert res["per_collective_s"] == 3e-3 and res["alpha_s"] == pytest.approx(3e-3 / 4)
    seen = {}

    def fake(fn, world, args, **kw):  # with gap_s each rank returns (cost, measured gap)
        seen["args"] = args
        return [(1e-3, 8e-3, 2e-3), (4e-3, 10e-3, 6e-3)]

    monkeypatch.setattr(ndtrain.spawn, "spawn", fake)
    res = measure_sync_latency(world=2, nbytes=2**20, gap_s=0.01)
    # the ranks' median waits, averaged (measured inside one loop: the trainer's busy / wait split)
    assert res["per_collective_s"] == pytest.approx(2.5e-3) and res["gap_measured_s"] == pytest.approx(9e-3)
    assert res["mean_wait_s"] == pytest.approx(4e-3)
    assert seen["args"][0] == 2**20 and seen["args"][-1] == 0.01 and seen["args"][2] == 150  # ~1.5 s


def _fake_run(path, dtype="float32", steps=((2, 0.9), (4, 0.5), (6, 0.5), (8, 0.52)), mem=400 * 2**20):
    cfg = Config()
    cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads, cfg.model.n_kv_heads = 64, 2, 4, 2
    cfg.model.vocab_size, cfg.model.ffn_hidden = 512, 128
    cfg.data.seq_len, cfg.training.global_batch_size, cfg.training.micro_batch_size = 32, 8, 2
    cfg.training.dtype = dtype
    path.mkdir()
    (path / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    lines = [{"step": 0, "val_loss": 6.2}] + [
        {"step": s, "loss": 6.0, "tokens_per_s": 256 / t, "step_time_s": t, "mfu": 0.05,
         "peak_mem_bytes": mem}
        for s, t in steps]
    (path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    return path


def test_compare_with_runs_on_a_deterministic_case(tmp_path):
    run = _fake_run(tmp_path / "run-a")
    rows = compare_with_runs([run], baseline_bytes=390 * 2**20)
    assert len(rows) == 1
    r = rows[0]
    assert r["layout"].startswith("DP1") and r["world"] == 1
    assert r["measured_step_s"] == pytest.approx(0.5)  # median after dropping the warm-up row
    assert r["measured_mem_bytes"] == 400 * 2**20
    # the tiny model: fp32 state is 16 bytes/param, the baseline dominates
    n = 2 * (64 * 4 * 16 * 2 + 2 * 64 * 2 * 16 + 3 * 64 * 128 + 2 * 64) + 512 * 64 * 2 + 64
    state = sum(r["memory_breakdown_bytes"][k] for k in ("params", "grads", "optimizer"))
    assert state == pytest.approx(16 * n, rel=0.01)
    assert abs(r["mem_rel_err"]) < 0.15
    assert "run-a" in format_comparison(rows)


def test_compare_with_runs_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        compare_with_runs([tmp_path / "missing"])
    run = _fake_run(tmp_path / "empty", steps=())
    with pytest.raises(ValueError, match="no step_time_s"):
        compare_with_runs([run])
