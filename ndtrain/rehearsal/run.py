"""A whole layout rehearsed: every rank role (``roles.rank_roles``) in its own process
(``python -m ndtrain.rehearsal.worker``), one after the other, beside the planner's memory estimate
of the same stage (``ndtrain.planner.memory.estimate_memory``).

The result (``rehearse``) is one dict, the JSON of ``ndtrain rehearse --json``: ``layout``,
``world``, ``hardware`` (name, device memory in bytes), and per role its ``role`` (``Role`` fields),
the worker's figures (``memory_peak``, ``ndtrain_state``, ``axis_bytes``, ``collectives``,
``step_s``, ``wall_s``, ``host_peak_bytes``, ``ops``, ``microbatches``, ``pack_replay``: the fast
path's counts, absent under ``fast=False``), ``fits`` (peak tensor bytes
<= device memory; the allocator's overhead is not in the peak), ``planner`` (its estimate for the
stage) and ``time`` (``timing.role_time``: estimated seconds on the hardware); and ``time``, the
job's estimated step and MFU (``timing.job_time``, over the roles rehearsed)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from ndtrain.config import Config
from ndtrain.rehearsal.roles import Role, rank_roles


class RehearsalError(RuntimeError):
    """A role's worker failed; the message names the role and its last error line."""


def _precision(dtype: str) -> tuple[str, int]:
    """The planner's (precision, activation bytes) for a trainer ``training.dtype``."""
    if dtype == "float64":
        return "fp64", 8
    return "fp32", (2 if dtype in ("bfloat16", "float16") else 4)


def planner_memory(cfg: Config, world: int, capacity: float) -> dict:
    """The planner's per-stage totals (bytes) and its peak stage's breakdown, or ``error`` (a model
    the planner cannot split)."""
    from ndtrain.calibration.calibrate import trainer_layout
    from ndtrain.planner.layout import Workload
    from ndtrain.planner.memory import estimate_memory
    from ndtrain.planner.model_spec import from_model_config

    precision, act = _precision(cfg.training.dtype)
    w = Workload(seq_len=cfg.data.seq_len, global_batch_tokens=cfg.training.global_batch_size * cfg.data.seq_len,
                 precision=precision, act_bytes=act, memory_model="trainer", fused_loss=cfg.training.fused_loss)
    try:
        est = estimate_memory(from_model_config(cfg.model), w, trainer_layout(cfg, world), capacity)
    except ValueError as e:
        return {"error": str(e)}
    return {"per_stage": est.per_stage, "peak_stage": est.stage, "peak_breakdown": est.breakdown,
            "precision": precision}


def run_role(preset: str, overrides: dict, world: int, role: Role, warmup: int = 1,
             timeout_s: float | None = None, routing: str | None = None, fast: bool = True) -> dict:
    """One role's worker process; returns its figures. ``fast``: the fake world's fast paths
    (``replay.fast_paths``; False: their slow twins, the same figures). Raises RehearsalError
    when it fails."""
    with tempfile.TemporaryDirectory(prefix="ndtrain_rehearse_") as tmp:
        job, out = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job.write_text(json.dumps({"preset": preset, "overrides": overrides, "world": world,
                                   "rank": role.rank, "warmup": warmup, "moe_routing": routing,
                                   "replay": fast}))
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        proc = subprocess.run([sys.executable, "-m", "ndtrain.rehearsal.worker", str(job), str(out)],
                              check=False, capture_output=True, text=True, timeout=timeout_s, env=env)
        if proc.returncode != 0 or not out.exists():
            lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
            last = lines[-1].replace("[rank0]: ", "") if lines else f"exit code {proc.returncode}"
            raise RehearsalError(f"rehearsal of {role.name} (rank {role.rank}) failed: {last}")
        return json.loads(out.read_text())


def rehearse(preset: str, overrides: dict, cfg: Config, world: int, hardware: str = "H100",
             warmup: int = 1, progress=None, only: list[int] | None = None, routing: str | None = None,
             fast: bool = True) -> dict:
    """Rehearse every role of ``cfg`` (loaded from ``preset`` + ``overrides``, valid for ``world``)
    on ``hardware`` (a planner accelerator name: its device memory decides ``fits``).
    ``progress(text)`` is told each role as it starts; ``only``: indices of the roles to rehearse
    (None: all); ``routing``: ``--moe-routing`` of an MoE model (``cfg`` already has
    ``training.moe_routing=balanced``); ``fast``: ``run_role``'s. Raises RehearsalError (a role failed),
    ValueError (unknown hardware; from ``planner.get_accelerator``)."""
    from ndtrain.mesh import ParallelDims
    from ndtrain.planner.hardware import get_accelerator

    acc = get_accelerator(hardware)
    dims = ParallelDims.from_config(cfg.parallel, world)
    roles = rank_roles(cfg, world, routing)
    plan = planner_memory(cfg, world, acc.hbm_bytes)
    out = {"preset": preset, "overrides": overrides, "layout": str(dims), "world": world,
           "hardware": {"name": acc.name, "memory_bytes": acc.hbm_bytes}, "moe_routing": routing, "roles": []}
    for i, role in enumerate(roles):
        if only is not None and i not in only:
            continue
        if progress:
            progress(f"rehearsing {role.name} (rank {role.rank}, {role.ranks_alike} ranks alike)")
        res = run_role(preset, overrides, world, role, warmup, routing=routing, fast=fast)
        res["role"] = asdict(role)
        res["fits"] = res["memory_peak"]["total"] <= acc.hbm_bytes
        if "per_stage" in plan:
            res["planner"] = {"total_bytes": plan["per_stage"][role.stage], "precision": plan["precision"]}
            if plan["peak_stage"] == role.stage:
                res["planner"]["breakdown"] = plan["peak_breakdown"]
        else:
            res["planner"] = {"error": plan["error"]}
        out["roles"].append(res)
    if out["roles"]:
        from ndtrain.rehearsal.timing import job_time

        out["time"] = job_time(out["roles"], cfg, world, hardware, out["roles"][0]["microbatches"])
        out["time"]["roles_rehearsed"] = len(out["roles"])
    return out
