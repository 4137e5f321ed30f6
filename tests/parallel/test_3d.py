"""3-D layouts on 8 processes: data x context x tensor parallel against the single-process oracle.

Reference: the same ``Trainer`` with a world-size-1 layout on the whole global batch
(``tests/parallel/layout_parity.py``). 10 float64 steps, clipping active, a cp shard without valid
labels on step 3. Tolerance 1e-6 relative: the layouts only reorder float64 sums.
Mesh order (outer to inner) dp_replicate, dp_shard, cp, tp: ranks 2k, 2k+1 form a tp pair, and
every rank of one tp x cp block reads the same samples.
"""
from __future__ import annotations

import pytest

from tests.dist_utils import run_ranks
from tests.parallel.layout_parity import assert_bytes, assert_parity, run_layout

pytestmark = pytest.mark.slow  # one 8-process spawn on 2 cores: ~1 min

CASES = {  # name: (run_layout kwargs, theory kwargs, axes checked (None = all))
    "dp2_cp2_tp2_sp_ring_ddp": (dict(dp_shard=2, cp=2, tp=2, sequence_parallel=True, hole=True),
                                dict(n_dp=2, n_cp=2, n_tp=2, sp=True), None),
    "dp2_cp2_tp2_sp_ring_zero3": (dict(dp_shard=2, cp=2, tp=2, sequence_parallel=True, zero_stage=3,
                                       hole=True), dict(n_dp=2, n_cp=2, n_tp=2, sp=True), ("tp", "cp")),
    "hsdp_r2_cp2_tp2_ulysses": (dict(dp_replicate=2, dp_shard=1, cp=2, tp=2, cp_impl="ulysses",
                                     zero_stage=3), dict(n_dp=2, n_cp=2, n_tp=2, impl="ulysses"), ("tp", "cp")),
}


def _cases(rank: int, world: int) -> dict:
    return {name: run_layout(rank, world, **kw) for name, (kw, _, _) in CASES.items()}


def test_dp_cp_tp_on_8_processes():
    """dp_shard2 x cp2 x tp2 with ring attention + SP under plain data parallel and under ZeRO-3
    (FSDP over dp_shard x cp), and HSDP (replicate 2 x shard over cp 2) x tp2 with Ulysses,
    reproduce the single-process run, per-parameter gradients included (ZeRO-3: this rank's rows).
    Bytes per axis equal the theory: tp (f / g pairs at B_local x T/cp), cp (K/V blocks of the
    local kv heads, or Ulysses all-to-alls), and under plain DP dp_cp (local gradients all-reduced
    over the 4 ranks of dp x cp); FSDP's own traffic is tested with FSDP."""
    res = run_ranks(_cases, 8, timeout_s=500)
    for name, (_, theory, axes) in CASES.items():
        per_rank = [r[name] for r in res]
        assert_parity(per_rank)
        assert_bytes(per_rank, axes=axes, **theory)
    for name in ("dp2_cp2_tp2_sp_ring_ddp", "dp2_cp2_tp2_sp_ring_zero3"):
        assert min(r[name]["n_valid_local"][3] for r in res) == 0  # cp rank 0 of each dp group
