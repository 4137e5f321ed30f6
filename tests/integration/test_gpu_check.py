"""``bench/gpu_check.sh OUTDIR --cpu`` runs every stage (tiny, on CPU) start to finish.

The GPU run cannot happen on a CPU machine; this pins the script's plumbing instead: each stage
exits 0, OUTDIR holds the promised files (at most 8), the JSON of each benchmark parses with its
machine facts, and every training variant logged a throughput row. Slow (several ``ndtrain
train`` launches, one with ``torch.compile``): marked ``slow``.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_check_cpu_mode_runs_every_stage(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, NDTRAIN_GPU_CHECK_WORK=str(tmp_path / "work"), OMP_NUM_THREADS="1")
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), str(out), "--cpu"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1500, check=False)
    assert proc.returncode == 0, (proc.stdout[-3000:], (out / "gpu_check.log").read_text()[-3000:])
    summary = json.loads((out / "summary.json").read_text())
    names = [s["stage"] for s in summary["stages"]]
    assert names[:4] == ["gpu_ops", "kernel_speed", "matmul_sweep", "roofline"] and names[-1] == "zero_fsdp2"
    assert {"mfu_eager", "mfu_triton"} <= set(names) and summary["all_passed"]
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and {"summary.json", "kernel_speed.json", "mfu_1b.json", "zero_vs_fsdp2.json"} <= set(files)
    ks = json.loads((out / "kernel_speed.json").read_text())
    assert len(ks["pairs"]) == 4 and all(p["output_rel_rms"] < 1e-5 for p in ks["pairs"])
    assert ks["machine"]["cpu_count"] >= 1
    for run, row in summary["mfu_1b"].items():
        assert row["tokens_per_s"] > 0 and row["step"] == 3, run
