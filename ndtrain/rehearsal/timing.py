"""Estimated step time and MFU of a rehearsed layout on a named accelerator, from the operators the
real step ran (``ops.OpRecorder`` rows) and the bytes it sent per mesh axis (the comm counters).

* **Each operator** by a roofline with the datasheet (``planner.accelerators``) and the planner's
  per-generation constants (``planner.compute.GENERATIONS``): a GEMM by ``compute.gemm_time``
  (2 M N K at ``gemm_efficiency`` x the tile / wave shape factor, or its HBM bytes, whichever is
  longer; batched and grouped GEMMs stacked along M); attention at ``attention_efficiency`` on the
  executed FLOPs (causal: half the square; backward: + the QK^T recompute, as FlashAttention) or
  its bytes; every other operator at its bytes / (``hbm_efficiency`` x HBM bandwidth); views none.
  The peak is the operator's input dtype's (bf16 / fp16, fp32, fp64).
* **Each mesh axis**: bytes sent / (link bandwidth x ``BANDWIDTH_EFFICIENCY``) + one link latency
  per collective, the link being the slowest one a group of the axis spans (``Cluster.link``:
  consecutive ranks, tp innermost, the mesh's order).
* **Overlap, as the code does it**: tp, cp, ep and pp transfers block the compute that needs them
  (exposed); data-parallel gradient reductions run asynchronously in buckets during the backward
  (ZeRO-3 / FSDP: their gathers during forward and backward too), so only what exceeds that window
  is exposed (the window: the last microbatch's backward, or ZeRO-3's whole forward + backward).
* **Pipeline**: a role's busy time is all its microbatches' compute + exposed comm; the job's step
  is the slowest role's busy time + the schedule's bubble (``planner.pipeline.estimate_pipeline_time``)
  on the slowest role's per-microbatch forward / backward.
* **MFU**: model FLOPs (``train.metrics.flops_per_token``, the trainer's own) x tokens per step /
  (step time x world x the dense 16-bit peak, or the fp32 / fp64 peak of such runs).
Units: seconds, FLOP/s, bytes.
"""
from __future__ import annotations

from ndtrain.planner.compute import compute_constants, gemm_time
from ndtrain.planner.hardware import BANDWIDTH_EFFICIENCY, Cluster, get_accelerator
from ndtrain.planner.pipeline import estimate_pipeline_time

DP_AXES = {"dp", "dp_shard", "dp_replicate", "dp_cp", "dp_shard_cp", "edp", "edp_shard"}
FLAT_HBM_EFFICIENCY = 1.0  # accelerators without a generation entry: the bare datasheet bandwidth


def _peak(acc, dtype: str) -> float:
    key = {"bfloat16": "bfloat16", "float16": "float16", "float64": "float64"}.get(dtype, "float32")
    return acc.peak_flops_per_s.get(key) or acc.peak("float32")


def op_seconds(row: dict, acc) -> float:
    """Seconds of one ``OpRecorder`` row (all its calls) on ``acc`` (an ``Accelerator``)."""
    c = compute_constants(acc)
    hbm_rate = acc.hbm_bytes_per_s * (c.hbm_efficiency if c else FLAT_HBM_EFFICIENCY)
    kind, n = row["kind"], row["count"]
    if kind in ("view", "comm") or n == 0:
        return 0.0
    if kind == "gemm":
        b, m, nn, k = row["dims"]
        el = 2 if row["dtype"] in ("bfloat16", "float16") else (8 if row["dtype"] == "float64" else 4)
        return n * gemm_time(b * m, nn, k, _peak(acc, row["dtype"]), acc.hbm_bytes_per_s, c, el)
    if kind == "attention":
        bt, h, tq, tk, dqk, _ = row["dims"]
        flops = row["flops"] / n
        if "backward" in row["op"]:
            flops += 2.0 * bt * h * tq * tk * dqk  # FlashAttention's backward recomputes Q K^T
        if row["causal"]:
            flops /= 2  # the causal half of the square is executed
        eff = c.attention_efficiency if c else acc.attention_gemm_ratio * 0.5
        return n * max(flops / (_peak(acc, row["dtype"]) * eff), row["bytes"] / n / hbm_rate)
    return row["bytes"] / hbm_rate


def compute_seconds(rows: list[dict], acc) -> dict:
    """Seconds per phase (``fwd``, ``bwd``, ``other``) and per kind, and FLOPs counted (GEMMs and
    attention, the counter's convention)."""
    phase = {"fwd": 0.0, "bwd": 0.0, "other": 0.0}
    kind: dict[str, float] = {}
    flops = 0.0
    for r in rows:
        s = op_seconds(r, acc)
        phase[r["phase"]] = phase.get(r["phase"], 0.0) + s
        kind[r["kind"]] = kind.get(r["kind"], 0.0) + s
        flops += r["flops"]
    return {"phase_s": phase, "kind_s": kind, "flops": flops}


def axis_spans(dims) -> dict[str, int]:
    """Consecutive ranks one group of each mesh axis spans (``mesh.AXES`` order, tp innermost; the
    expert mesh (pp, dp_replicate, edp_shard, ep, tp)). ``dims``: ``ParallelDims``."""
    tp, cp, ds, dr = dims.tp, dims.cp, dims.dp_shard, dims.dp_replicate
    inner = tp * cp * ds * dr
    return {"tp": tp, "cp": tp * cp, "dp_shard": tp * cp * ds, "dp_shard_cp": tp * cp * ds, "ep": tp * dims.ep,
            "dp_replicate": inner, "dp": inner, "dp_cp": inner, "edp": inner, "edp_shard": inner,
            "pp": inner * dims.pp}


def comm_seconds(axis_bytes: dict, collectives: dict, cluster: Cluster, dims) -> dict[str, float]:
    """Seconds per mesh axis: bytes / (link x efficiency) + a latency per collective."""
    spans = axis_spans(dims)
    out = {}
    for axis in sorted(set(axis_bytes) | set(collectives)):
        _, bw, lat = cluster.link(spans.get(axis, cluster.gpus))
        calls = sum(collectives.get(axis, {}).values())
        out[axis] = axis_bytes.get(axis, 0.0) / (bw * BANDWIDTH_EFFICIENCY) + calls * lat
    return out


def role_time(res: dict, cluster: Cluster, dims, zero_stage: int, microbatches: int) -> dict:
    """One role's ``busy_s`` (compute + exposed comm), its per-microbatch ``fwd_mb_s`` / ``bwd_mb_s``
    (compute + exposed blocking comm, shared in proportion), and the breakdown."""
    comp = compute_seconds(res["ops"], cluster.accelerator)
    comm = comm_seconds(res["axis_bytes"], res["collectives"], cluster, dims)
    fwd, bwd, other = comp["phase_s"]["fwd"], comp["phase_s"]["bwd"], comp["phase_s"]["other"]
    blocking = sum(s for a, s in comm.items() if a not in DP_AXES)
    window = fwd + bwd if zero_stage == 3 else bwd / max(microbatches, 1)
    dp_exposed = max(0.0, sum(s for a, s in comm.items() if a in DP_AXES) - window)
    share = fwd / (fwd + bwd) if fwd + bwd > 0 else 0.5
    m = max(microbatches, 1)
    return {"busy_s": fwd + bwd + other + blocking + dp_exposed, "compute_s": comp["phase_s"],
            "compute_by_kind_s": comp["kind_s"], "comm_s": comm, "comm_exposed_s": blocking + dp_exposed,
            "fwd_mb_s": (fwd + share * blocking) / m, "bwd_mb_s": (bwd + (1 - share) * blocking) / m,
            "op_flops": comp["flops"]}


def job_time(roles: list[dict], cfg, world: int, hardware: str, microbatches: int) -> dict:
    """Step time and MFU of the job from its rehearsed roles (``run.rehearse``'s, each with
    ``ops``); adds ``time`` to each role. The job's step: the slowest role's busy time + the
    pipeline bubble on the slowest per-microbatch stage. Raises ValueError (unknown hardware)."""
    from ndtrain.mesh import ParallelDims
    from ndtrain.train.metrics import flops_per_token

    dims = ParallelDims.from_config(cfg.parallel, world)
    cluster = Cluster(get_accelerator(hardware), world)
    p = cfg.parallel
    for r in roles:
        r["time"] = role_time(r, cluster, dims, p.zero_stage, microbatches)
    busy = max(r["time"]["busy_s"] for r in roles)
    slow = max(roles, key=lambda r: r["time"]["fwd_mb_s"] + r["time"]["bwd_mb_s"])["time"]
    v = p.pp_virtual_stages if p.pp_schedule == "interleaved" else 1
    pipe = estimate_pipeline_time(slow["fwd_mb_s"], slow["bwd_mb_s"], dims.pp, microbatches, p.pp_schedule, v) \
        if dims.pp > 1 else {"bubble": 0.0}
    step = busy + pipe["bubble"]
    tokens = cfg.training.global_batch_size * cfg.data.seq_len
    model_flops = flops_per_token(cfg.model, cfg.data.seq_len) * tokens
    sixteen = cfg.training.dtype in ("bfloat16", "float16")
    peak = cluster.accelerator.peak("bfloat16") if sixteen else _peak(cluster.accelerator, cfg.training.dtype)
    return {"step_s": step, "busy_s": busy, "bubble_s": pipe["bubble"], "model_flops": model_flops,
            "tokens": tokens, "mfu": model_flops / (step * world * peak) if step > 0 else 0.0,
            "peak_flops_per_s": peak, "microbatches": microbatches,
            "note": "estimated: per-op roofline of the rehearsed operators, comm from counted bytes"}
