"""The benchmark harness (``ndtrain.tools.bench_utils``) and the pure parts of the new benchmarks.

Exact expectations where the harness promises them: the number of calls, the peak of live storages
(two tensors of known size alive at once, or one after the other), the JSON's machine facts, and
the crossover rule of ``bench/attention_alternatives.py``.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from ndtrain.tools import bench_utils

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))


def test_time_fn_calls_and_median():
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.002)

    tm = bench_utils.time_fn(fn, "cpu", warmup=2, repeats=3)
    assert len(calls) == 5 and len(tm.times_s) == 3
    assert tm.min_s >= 0.002 and tm.min_s <= tm.median_s == sorted(tm.times_s)[1]
    with pytest.raises(ValueError, match="repeats"):
        bench_utils.time_fn(fn, "cpu", repeats=0)


def test_peak_bytes_counts_live_storages():
    mib = 2**20

    def both_alive():
        a = torch.empty(mib // 4)  # 1 MiB fp32
        b = torch.empty(2 * mib // 4)  # 2 MiB while a lives
        return a, b

    def one_after_other():
        a = torch.empty(mib // 4)
        del a
        return torch.empty(2 * mib // 4)

    assert bench_utils.peak_bytes(both_alive, "cpu") == 3 * mib
    assert bench_utils.peak_bytes(one_after_other, "cpu") == 2 * mib


def test_write_result_adds_machine_and_date(tmp_path):
    path = bench_utils.write_result(tmp_path / "sub" / "r.json", {"x": 1}, "cpu")
    data = json.loads(path.read_text())
    assert data["x"] == 1 and data["date"].endswith("Z")
    m = data["machine"]
    assert m["device"] == "cpu" and m["cpu_count"] >= 1 and len(m["load_avg_1_5_15"]) == 3
    assert m["torch"] == torch.__version__


def test_cpu_peak_estimate_is_the_larger_ceiling():
    est = bench_utils.cpu_peak_estimate("float32")
    assert est["measured"] > 0 and est["peak"] == max(est["theoretical"] or 0.0, est["measured"])
    if est["theoretical"]:
        assert est["theoretical"] == pytest.approx(est["cores"] * est["nominal_mhz"] * 1e6 * est["flops_per_cycle_per_core"])


def test_crossover_rule():
    from attention_alternatives import crossover

    base = [{"T": t, "tokens_per_s": v} for t, v in ((256, 10.0), (1024, 8.0), (4096, 4.0), (16384, 1.0))]
    rows = lambda *v: [{"T": t, "tokens_per_s": x} for t, x in zip((256, 1024, 4096, 16384), v, strict=True)]
    assert crossover(base, rows(5.0, 9.0, 5.0, 2.0)) == 1024
    assert crossover(base, rows(11.0, 9.0, 3.0, 2.0)) == 16384  # a loss at 4096 resets the run
    assert crossover(base, rows(5.0, 5.0, 3.0, 0.5)) is None
    assert crossover(base, rows(5.0, 9.0, 5.0, 2.0)[:3] + [{"T": 16384, "skipped": "cap"}]) == 1024
