"""The rehearsal's pipeline messages carry what the real peers send: under ZeRO 1-3 with bf16 the
weights are bf16, so the residual stream a stage sends is bf16 (a fake float32 message made every
later stage run in float32 and kept float32 copies of its weights: 12% more on stage 1 of a bf16
``deepseek_v3_debug`` pp2 x ep2 before the fix). Same check as ``test_rehearsal._check``: bytes per
axis and collectives equal, every memory category within 5%."""
from __future__ import annotations

from tests.rehearsal.test_rehearsal import _check


def test_rehearsal_equals_real_run_pp2_zero1_bf16():
    over = {"parallel.pp": 2, "parallel.zero_stage": 1, "training.dtype": "bfloat16"}
    res = _check(2, "debug", over)
    first, last = res["roles"]
    assert last["memory_peak"]["total"] > 0 and first["memory_peak"]["total"] > 0

