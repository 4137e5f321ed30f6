"""``ndtrain plan --rehearse K``: the planner's top K candidates rehearsed (``ndtrain.rehearsal``:
the real trainer per rank role, on a fake world of the full size, one process per role), ranked by
whether their rehearsed peak fits the device and then by the planner's step time.

Speed: one rehearsed role per distinct stage that can hold the peak (the first, the last, the
planner's peak stage: blocks of the middle stages are alike and hold fewer microbatches than the
first), and no more microbatches than the peak needs: min(m, in flight + 1) per pipeline (one
more than the first stage keeps in flight, so the steady state with gradients present is reached;
pp = 1: 2). Memory peaks at a stage's steady state do not grow with further microbatches, so the
rehearsed peak is the full batch's; the planner's figures are for the full batch.

Each candidate's rehearsal is cached as JSON under ``cache_dir`` (key: the preset, its overrides
and the world), so a second ``plan --rehearse`` reuses it."""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import replace
from pathlib import Path

from ndtrain.planner.layout import config_overrides, microbatches
from ndtrain.planner.memory import estimate_memory
from ndtrain.planner.pipeline import inflight_microbatches


def rehearsal_overrides(lay, w) -> dict:
    """Config overrides that run ``lay`` on ``w`` with the fewest microbatches that reach the peak
    (module docstring)."""
    over = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in config_overrides(lay, w).items()}
    m = microbatches(lay, w)
    if lay.pp == 1:
        need = 2
    else:  # whole rounds of pp microbatches (schedules that need m % pp == 0 accept it)
        held = inflight_microbatches(lay.pp, m, lay.pp_schedule, lay.pp_virtual_stages, 0) * lay.pp_virtual_stages
        need = -(-(int(held) + 1) // lay.pp) * lay.pp
    m_reh = min(m, need)
    over["training.global_batch_size"] = str(m_reh * lay.microbatch * lay.dp)
    return over


def _stages_to_rehearse(pp: int, peak_stage: int) -> list[int]:
    return sorted({0, pp - 1, peak_stage})


def _cached(cache_dir, key: dict, compute):
    if cache_dir is None:
        return compute()
    path = Path(cache_dir) / (hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16] + ".json")
    if path.exists():
        return json.loads(path.read_text())
    out = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out))
    return out


def rehearse_plan(preset: str, spec, cluster, w, plan, cache_dir=None, progress=None) -> dict:
    """Rehearse one planner ``plan`` (a ``search.Plan``); returns its record: ``layout``, the
    planner's per-stage bytes (``w.memory_model``) and step time, per rehearsed stage the rehearsed
    peak (``rehearsed_bytes``, by category) beside the planner's (``planner_bytes``, relative
    ``error``), ``fits`` and, if it does not, ``reason``; ``wall_s``. A layout ``ndtrain train``
    rejects, or whose rehearsal fails, gets ``fits`` False and the rule or error as ``reason``."""
    from ndtrain.config import ConfigError, load_config
    from ndtrain.rehearsal.roles import rank_roles
    from ndtrain.rehearsal.run import RehearsalError, rehearse

    lay, acc = plan.layout, cluster.accelerator
    # tensor bytes only, as the rehearsal's peak: no runtime reserve, no allocator overhead
    est = estimate_memory(spec, w, lay, acc.hbm_bytes)
    rec = {"layout": str(lay), "planner_step_time_s": plan.step.step_time_s if plan.step else None,
           "planner_per_stage_bytes": est.per_stage, "planner_peak_stage": est.stage,
           "memory_model": w.memory_model, "capacity_bytes": acc.hbm_bytes, "stages": []}
    if plan.unsupported:
        return {**rec, "fits": False, "reason": "ndtrain train rejects it: " + "; ".join(plan.unsupported)}
    over = rehearsal_overrides(lay, w)
    routing = "balanced" if spec.is_moe else None
    if routing:
        over["training.moe_routing"] = "balanced"
    t0 = time.perf_counter()
    try:
        cfg = load_config(preset, over, world_size=cluster.gpus)
        roles = rank_roles(cfg, cluster.gpus)
        want = _stages_to_rehearse(lay.pp, est.stage)
        only = [i for i, r in enumerate(roles) if r.stage in want]
        key = {"preset": preset, "overrides": over, "world": cluster.gpus, "only": only, "hw": acc.name}
        res = _cached(cache_dir, key, lambda: rehearse(preset, over, cfg, cluster.gpus, acc.name, 1,
                                                         progress, only, routing))
    except (ConfigError, RehearsalError, ValueError) as e:
        return {**rec, "fits": False, "reason": f"rehearsal failed: {e}", "wall_s": time.perf_counter() - t0}
    rec["overrides"] = over
    rec["wall_s"] = time.perf_counter() - t0
    for r in res["roles"]:
        st, peak = r["role"]["stage"], r["memory_peak"]["total"]
        p = est.per_stage[st]
        rec["stages"].append({"stage": st, "role": r["role"]["name"], "rehearsed_bytes": peak,
                              "rehearsed_by_category": r["memory_peak"], "planner_bytes": p,
                              "error": p / peak - 1.0 if peak else None, "role_wall_s": r.get("wall_s")})
    worst = max(rec["stages"], key=lambda s: s["rehearsed_bytes"])
    rec["rehearsed_peak_bytes"] = worst["rehearsed_bytes"]
    rec["fits"] = worst["rehearsed_bytes"] <= acc.hbm_bytes
    if not rec["fits"]:
        rec["reason"] = (f"rehearsed peak {worst['rehearsed_bytes'] / 2**30:.1f} GiB on stage {worst['stage']} "
                         f"> {acc.hbm_bytes / 2**30:.1f} GiB")
    return rec


def rehearse_top(preset: str, spec, cluster, w, plans, k: int, cache_dir=None, progress=None) -> list[dict]:
    """The first ``k`` of ``plans`` that the planner says fit, rehearsed (``rehearse_plan``) and
    ranked: rehearsed fits first, then the planner's step time; each record gets ``rank`` (1..) if
    it fits, else None (dropped, with its ``reason``)."""
    picked = [p for p in plans if p.fits and not p.errors][:k]
    recs = [rehearse_plan(preset, spec, cluster, w, p, cache_dir, progress) for p in picked]
    recs.sort(key=lambda r: (not r["fits"], r["planner_step_time_s"] or float("inf")))
    n = 0
    for r in recs:
        n += r["fits"]
        r["rank"] = n if r["fits"] else None
    return recs


def trainer_workload(w):
    """``w`` with the trainer's memory accounting (what the rehearsal measures)."""
    return replace(w, memory_model="trainer")


def add_rehearse_args(p) -> None:
    """``--rehearse K``, ``--rehearse-cache DIR``, ``--memory-model`` on the plan parser ``p``."""
    p.add_argument("--rehearse", type=int, default=0, metavar="K",
                   help="rehearse the top K candidates (ndtrain rehearse, one process per role) and rank "
                        "them by rehearsed fit, then planner time; implies --memory-model trainer")
    p.add_argument("--rehearse-cache", default="", metavar="DIR", help="cache each rehearsal's JSON here")
    p.add_argument("--memory-model", default="", choices=("", "fused", "trainer"),
                   help="fused: fused-kernel GPU training (default); trainer: ndtrain's own eager modules "
                        "(what ndtrain rehearse measures; default with --rehearse)")


def print_rehearsed(recs: list[dict], as_json: bool) -> None:
    """The rehearsed ranking: one JSON line ``{"rehearsed": [...]}`` or a table."""
    if as_json:
        print(json.dumps({"rehearsed": recs}))
        return
    print("\nrehearsed (peak per stage, GiB: rehearsal / planner):")
    for r in recs:
        stages = ", ".join(f"s{s['stage']} {s['rehearsed_bytes'] / 2**30:.1f}/{s['planner_bytes'] / 2**30:.1f}"
                           for s in r["stages"])
        head = f"  {r['rank'] if r['rank'] else '-'} {r['layout']}"
        tail = "" if r["fits"] else f"  DROPPED: {r['reason']}"
        print(f"{head}\n      {stages or 'not rehearsed'}  ({r.get('wall_s', 0):.0f} s){tail}")
