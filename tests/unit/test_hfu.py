"""HFU: the recompute FLOPs of each activation-checkpointing policy, measured.

Reference: ``torch.utils.flop_counter.FlopCounterMode`` over one forward + backward of a tiny model
with the policy applied by ``ndtrain.parallel.activation_ckpt``; the counter sees every matmul that
really runs, including torch's early-stopped recompute, and (with the mapping below) the CPU SDPA
kernel. The extra FLOPs over ``none`` must equal ``recompute_flops_per_token * tokens``. Tolerance
0.5%: the formula counts the norm gains at 2 FLOPs per parameter (PaLM's 6N convention), which the
counter does not see (0.3% of a block here).
"""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from ndtrain.config import ModelConfig
from ndtrain.model import build_model
from ndtrain.parallel.activation_ckpt import apply_activation_checkpoint
from ndtrain.train.metrics import flops_per_token, format_line, hfu_factor, recompute_flops_per_token

_SDPA = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_SDPA_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _sdpa_fwd(q, k, v, *args, out_shape=None, **kw):  # the counter passes shapes, not tensors
    return sdpa_flop_count(q, k, v)


def _sdpa_bwd(dout, q, k, v, *args, out_shape=None, **kw):
    return sdpa_backward_flop_count(dout, q, k, v)


def _measured(cfg: ModelConfig, policy: str, b: int, t: int) -> int:
    model = build_model(cfg, "cpu", torch.float32, seed=0)
    apply_activation_checkpoint(model, policy)
    x = torch.randint(0, cfg.vocab_size, (b, t))
    mapping = {_SDPA: _sdpa_fwd, _SDPA_BWD: _sdpa_bwd}  # CPU SDPA has no built-in formula
    with FlopCounterMode(display=False, custom_mapping=mapping) as fc:
        model(x).sum().backward()
    return fc.get_total_flops()


CFG = ModelConfig(vocab_size=128, dim=64, n_layers=5, n_heads=4, ffn_hidden=128, max_seq_len=64)


@pytest.mark.parametrize("policy", ["full", "every:2", "every:3", "every:5", "sqrt", "selective"])
def test_recompute_flops_match_the_counter(policy):
    b, t = 2, 16
    base = _measured(CFG, "none", b, t)
    extra = _measured(CFG, policy, b, t) - base
    want = recompute_flops_per_token(CFG, t, policy) * b * t
    assert extra > 0
    assert extra == pytest.approx(want, rel=5e-3), (policy, extra, want)


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_hybrid_layers_recompute(policy):
    """Attention + linear-attention layers (``layer_pattern="AL"``): selective adds only the two
    softmax cores (exact); full recompute is within 3%, because a linear mixer's FLOPs follow the
    model-FLOPs convention of ``ndtrain.mixer_spec`` rather than its chunked kernel's exact count."""
    cfg = ModelConfig(vocab_size=128, dim=64, n_layers=4, n_heads=4, ffn_hidden=128, max_seq_len=64,
                      layer_pattern="AL")
    extra = _measured(cfg, policy, 2, 16) - _measured(cfg, "none", 2, 16)
    want = recompute_flops_per_token(cfg, 16, policy) * 32
    assert extra == pytest.approx(want, rel=3e-2 if policy == "full" else 1e-9)


def test_hfu_factor_values():
    """none = 1; full < every:C (two levels replay more) ; selective adds only the attention core."""
    t = 16
    assert hfu_factor(CFG, t, "none") == 1.0
    full, ev5, sel = (hfu_factor(CFG, t, p) for p in ("full", "every:5", "selective"))
    assert 1.0 < sel < full < ev5 < 4 / 3 + 1 / 3  # at most two extra forwards of a third each
    core = 2 * CFG.n_heads * 2 * CFG.head_dim * t * CFG.n_layers  # QK^T + AV forward, all layers
    assert sel == pytest.approx(1 + core / flops_per_token(CFG, t))


def test_log_line_shows_hfu():
    line = format_line({"step": 3, "loss": 1.0, "mfu": 0.2, "hfu": 0.25})
    assert "mfu 20.0%" in line and "hfu 25.0%" in line


# ---- peak FLOP/s: the planner's datasheet table; the CPU reading vetted -------------------------

# The datasheet peaks MFU divided by before the table moved to the planner (dense, FLOP/s).
_OLD_PEAKS = {  # device name: (bf16, fp32 (TF32 tensor cores), fp64, fp8 or None)
    "NVIDIA H100 80GB HBM3": (989.4e12, 494.7e12, 66.9e12, 1978.9e12),
    "NVIDIA H200": (989.4e12, 494.7e12, 66.9e12, 1978.9e12),
    "NVIDIA A100-SXM4-80GB": (312e12, 156e12, 19.5e12, None),
    "NVIDIA B200": (2250e12, 1125e12, 40e12, 4500e12),
    "AMD Instinct MI300X": (1307.4e12, 653.7e12, 163.4e12, 2614.9e12),
}


@pytest.mark.parametrize("name", list(_OLD_PEAKS))
def test_gpu_peaks_come_from_the_planner_table_unchanged(name):
    from ndtrain.planner.accelerators import HARDWARE
    from ndtrain.planner.hardware import device_accelerator
    from ndtrain.train.peak import UnknownPeak, gpu_peak_flops

    bf16, fp32, fp64, fp8 = _OLD_PEAKS[name]
    assert gpu_peak_flops(name, "bfloat16") == gpu_peak_flops(name, "float16") == bf16
    assert gpu_peak_flops(name, "float32") == fp32 and gpu_peak_flops(name, "float64") == fp64
    assert gpu_peak_flops(name, "bfloat16") == HARDWARE[device_accelerator(name)].peak("bf16")
    if fp8 is None:
        with pytest.raises(UnknownPeak, match="unknown fp8 peak FLOP/s for 'NVIDIA A100-SXM4-80GB'"):
            gpu_peak_flops(name, "bfloat16", fp8=True)
    else:
        assert gpu_peak_flops(name, "bfloat16", fp8=True) == fp8


def test_device_names_find_their_table_row():
    from ndtrain.planner.hardware import device_accelerator
    from ndtrain.train.peak import UnknownPeak, gpu_peak_flops

    assert device_accelerator("NVIDIA H100 NVL") == "H100-NVL"  # not the SXM part's 989 TFLOP/s
    assert gpu_peak_flops("NVIDIA H100 NVL", "bfloat16") == 835.5e12
    assert device_accelerator("NVIDIA GH200 480GB") == "GH200" and device_accelerator("NVIDIA H800") == "H800"
    assert device_accelerator("NVIDIA A100-SXM4-40GB") == "A100-80GB"  # same compute, either memory
    with pytest.raises(UnknownPeak, match=r"unknown peak FLOP/s for 'NVIDIA GeForce RTX 4090'; set logging"):
        gpu_peak_flops("NVIDIA GeForce RTX 4090", "bfloat16")


class _Meter:
    """A fake matmul benchmark: returns the given FLOP/s readings in turn and counts calls."""

    def __init__(self, *readings):
        self.readings, self.calls = list(readings), 0

    def __call__(self):
        self.calls += 1
        return self.readings.pop(0)


@pytest.fixture
def fresh_peaks(tmp_path, monkeypatch):
    """An empty peak cache and no reading taken in this process yet."""
    from ndtrain.train import peak

    monkeypatch.setenv("NDTRAIN_CACHE", str(tmp_path))
    monkeypatch.setattr(peak, "_READINGS", {})
    monkeypatch.setattr(peak, "_RECHECKED", set())
    return peak


def test_first_cpu_reading_on_an_idle_machine_is_trusted(fresh_peaks):
    m = _Meter(100e9)
    r = fresh_peaks.cpu_peak("float32", measure=m, busy=lambda: False)
    assert (r.value, r.remeasured, r.under_load, m.calls) == (100e9, False, False, 1)
    assert fresh_peaks.peak_basis(torch.device("cpu"), "float32") == "cpu float32 measured"
    assert fresh_peaks.cpu_peak("float32", measure=_Meter()) is r  # one reading per process


def test_first_cpu_reading_on_a_busy_machine_is_retaken_then_flagged(fresh_peaks):
    m = _Meter(40e9, 45e9)
    r = fresh_peaks.cpu_peak("float32", measure=m, busy=lambda: True)
    assert (r.value, r.remeasured, r.under_load, m.calls) == (45e9, True, True, 2)
    cpu = torch.device("cpu")
    assert fresh_peaks.peak_basis(cpu, "float32") == "cpu float32 measured under load"
    assert fresh_peaks.peak_flops(cpu, "float32") == 45e9
    assert fresh_peaks.peak_basis(cpu, "float32", override=1e9) == "override"


def test_a_low_reading_against_the_cache_is_retaken_and_the_cached_best_kept(fresh_peaks):
    fresh_peaks.cpu_peak("float32", measure=_Meter(100e9), busy=lambda: False)  # an earlier run
    fresh_peaks._READINGS.clear()
    m = _Meter(30e9, 35e9)  # under half the cached 100: measured again, the cache stands
    r = fresh_peaks.cpu_peak("float32", measure=m, busy=lambda: True)
    assert (r.value, r.fresh, r.cached, r.remeasured, r.under_load, m.calls) == (100e9, 35e9, 100e9, True, False, 2)
    fresh_peaks._READINGS.clear()
    m = _Meter(80e9)  # a plausible reading: no second measurement
    assert fresh_peaks.cpu_peak("float32", measure=m).value == 100e9 and m.calls == 1


def test_an_implausible_cpu_mfu_remeasures_once_and_rescales_the_row(fresh_peaks):
    cpu = torch.device("cpu")
    fresh_peaks.cpu_peak("float32", measure=_Meter(50e9), busy=lambda: False)
    basis = fresh_peaks.peak_basis(cpu, "float32")
    row = {"mfu": 0.9, "hfu": 1.2}
    m = _Meter(150e9)
    peak, basis = fresh_peaks.recheck_cpu_peak(row, 50e9, basis, cpu, "float32", measure=m, busy=lambda: False)
    assert (peak, basis, m.calls) == (150e9, "cpu float32 measured", 1)
    assert row == {"mfu": pytest.approx(0.3), "hfu": pytest.approx(0.4), "mfu_peak": "cpu float32 measured"}
    row = {"mfu": 0.95}
    assert fresh_peaks.recheck_cpu_peak(row, peak, basis, cpu, "float32", measure=_Meter())[0] == 150e9  # once
    assert row == {"mfu": 0.95, "mfu_peak": "cpu float32 measured"}


def test_an_mfu_still_implausible_after_remeasuring_is_flagged(fresh_peaks):
    cpu = torch.device("cpu")
    fresh_peaks.cpu_peak("float32", measure=_Meter(50e9), busy=lambda: False)
    row = {"mfu": 0.9, "hfu": None}
    peak, basis = fresh_peaks.recheck_cpu_peak(row, 50e9, "cpu float32 measured", cpu, "float32",
                                               measure=_Meter(55e9), busy=lambda: False)
    assert peak == 55e9 and basis == "cpu float32 measured under load"
    assert row == {"mfu": pytest.approx(0.9 * 50 / 55), "hfu": None, "mfu_peak": "cpu float32 measured under load"}


def test_plausible_or_datasheet_mfu_rows_are_left_alone(fresh_peaks):
    for dev, basis, mfu in ((torch.device("cpu"), "cpu float32 measured", 0.8), (torch.device("cpu"), "override", 0.99),
                            (torch.device("cuda"), "H100 bfloat16 datasheet", 0.99)):
        row = {"mfu": mfu}
        assert fresh_peaks.recheck_cpu_peak(row, 1e12, basis, dev, "float32", measure=_Meter()) == (1e12, basis)
        assert row == {"mfu": mfu, "mfu_peak": basis}
