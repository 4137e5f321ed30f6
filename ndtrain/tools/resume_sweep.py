"""Resume sweep: every combination that trains, stopped at a step and resumed.

For one combination (``ndtrain.tools.sweep.Combo``, run ``RESUME_STEPS`` steps) in its layout A:

* **uninterrupted** (U): A trains steps 1..N and saves a checkpoint at the stop step k with the run
  loop's own ``_save`` (synchronous, or asynchronous under ``checkpoint.async_save``, training on
  while the write is in flight), as a run with ``checkpoint.every`` does;
* **same layout** (R): a fresh trainer of layout A loads that checkpoint with the run loop's own
  ``_resume`` (weights, optimizer, LR schedule, sampler position, loss scale, DiLoCo state) and
  trains k+1..N. Its per-step values (``RESUME_COMPARED``) and its whole final state (every tensor
  of ``Trainer.tensor_state``: weights, buffers such as the MoE ``expert_bias``, AdamW moments and
  steps, DiLoCo anchor and momentum), gathered whole, must equal U's **bitwise**, in every dtype
  (the same layout replays the same arithmetic);
* **other layout** (O, ``other_layout``): a trainer of another layout B of the same world size
  loads the same checkpoint. Right after loading, its state gathered whole must equal U's at step
  k bitwise (resharding moves bytes, it does not compute); then it trains k+1..N, and its values
  and final state must equal U's to the layout tolerance of the dtype
  (``ndtrain.tools.sweep.TOLERANCE``; bf16 / fp16: finite), since B sums in another order.

The stop step k comes from ``training.stop_at_step`` when a combination sets it (a DiLoCo run
stopped inside an outer interval), else ``RESUME_STOP``. Batches: a fixed table of sequences read
through the run's ``GlobalBatchSampler``, so the data position is part of what resumes.
"""
from __future__ import annotations

import copy
import math
import shutil
import zlib
from pathlib import Path

import torch

from ndtrain.config import Config, ConfigError
from ndtrain.tools.sweep import TOLERANCE, Combo, T, V, build_config, layout_name, make_combo

RESUME_STEPS, RESUME_STOP = 4, 2  # N optimizer steps; checkpoint (stop) after step k
N_SEQ = 32  # sequences of the fixed table the sampler draws from (8 global batches)
RESUME_COMPARED = ("loss", "grad_norm", "aux_loss", "mtp_loss", "lr", "n_tokens", "loss_scale")

_PP1 = {"pp": 2, "pp_virtual_stages": 1, "pp_schedule": "1f1b"}
# candidate "other layouts" per world size; ``other_layout`` takes the first (from a position
# picked by the combination's key) that differs from the combination's and validates
OTHER = {
    2: ({"dp_shard": 2}, {"tp": 2, "sequence_parallel": True}, _PP1, {"dp_replicate": 2},
        {"cp": 2, "cp_impl": "ring"}, {"dp_shard": 2, "ep": 2}, {"tp": 2}),
    4: ({"dp_shard": 2, "tp": 2}, {**_PP1, "dp_shard": 2}, {"dp_shard": 4}, {"dp_replicate": 2, "dp_shard": 2},
        {"dp_replicate": 2, "tp": 2}, {"dp_shard": 2, "cp": 2, "cp_impl": "ulysses"}, {"dp_shard": 4, "ep": 2},
        {"dp_replicate": 2, **_PP1}),
    8: ({"dp_shard": 2, "tp": 2, **_PP1}, {"dp_shard": 8}, {"dp_replicate": 2, "dp_shard": 2, "tp": 2}),
}


def stop_step(combo: Combo) -> int:
    return int(dict(combo.extra).get("training.stop_at_step", RESUME_STOP))


def resume_config(combo: Combo) -> Config:
    """``build_config`` of ``combo`` run for ``RESUME_STEPS`` steps with its stop step set."""
    over = dict(combo.extra)
    over.setdefault("training.stop_at_step", RESUME_STOP)
    c = Combo(**{**combo.__dict__, "extra": tuple(sorted({**over, "training.steps": RESUME_STEPS}.items()))})
    return build_config(c)


def check_resume(combo: Combo) -> str | None:
    """None if the config the resume sweep runs (``resume_config``: ``RESUME_STEPS`` steps, its stop
    step) passes validation, else the rule that rejected it."""
    try:
        resume_config(combo)
    except ConfigError as e:
        return str(e)
    return None


def other_layout(combo: Combo) -> Combo | None:
    """Another layout of ``combo``'s world size for the same model, dtype, checkpointing and extra
    settings, or None when none validates (one rank: the other ZeRO stage of the single process).
    ZeRO: the next stage (mod 4) when it validates, else 0."""
    if combo.world == 1:
        return _variant(combo, {}, 3 if combo.zero == 0 else 0)
    cands = OTHER.get(combo.world, ())
    start = zlib.crc32(combo.key.encode()) % max(len(cands), 1)
    for par in cands[start:] + cands[:start]:
        if layout_name(par) == combo.layout:
            continue
        for zero in ((combo.zero + 1) % 4, 0):
            other = _variant(combo, par, zero)
            if other is not None:
                return other
    return None


def _variant(combo: Combo, par: dict, zero: int) -> Combo | None:
    other = make_combo(combo.feature, combo.world, par, combo.tier, zero=zero, ac=combo.ac, dtype=combo.dtype,
                       fused=combo.fused, extra=combo.extra)
    return other if check_resume(other) is None else None


# ---------------------------------------------------------------------------------------------
# inside one rank


def _table() -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed (N_SEQ, T) inputs and labels (about a quarter of the labels masked)."""
    g = torch.Generator().manual_seed(9001)
    seq = torch.randint(0, V, (N_SEQ, T + 1), generator=g)
    labels = seq[:, 1:].clone()
    labels[torch.rand(N_SEQ, T, generator=g) < 0.25] = -100
    return seq[:, :-1], labels


def _new_run(cfg: Config, world: int, mesh, run_dir: Path):
    """A ``ndtrain.train.loop._Run`` without data files (batches come from ``_table``)."""
    import torch.distributed as dist

    from ndtrain.data import GlobalBatchSampler
    from ndtrain.train.loop import Trainer, _Run

    rank = dist.get_rank() if world > 1 else 0
    t = cfg.training
    torch.manual_seed(t.seed)  # as the run's set-up does before building the model
    trainer = Trainer(cfg, mesh, torch.device("cpu"))
    sampler = GlobalBatchSampler(N_SEQ, t.global_batch_size, t.seed)
    return _Run(cfg, rank, world, torch.device("cpu"), mesh.dims, mesh, trainer, None, sampler, run_dir)


def _step(r, table) -> dict[str, float]:
    """One step of the run ``r`` on its sampler's next global batch (this rank's slice)."""
    dp = r.mesh.group("dp")
    idx = r.sampler.local_slice(r.sampler.next_global(), dp.rank, dp.size)
    out = r.trainer.step(table[0][idx], table[1][idx])
    return {k: float(out[k]) for k in RESUME_COMPARED if k in out}


def _flat(tree: dict, prefix: str = "") -> dict:
    """Every leaf of a state tree by dotted name; DTensors gathered whole (collective), tensors
    copied to CPU."""
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, name + "."))
        elif isinstance(v, DTensor):
            out[name] = v.full_tensor().detach().cpu().clone()
        elif torch.is_tensor(v):
            out[name] = v.detach().cpu().clone()
        else:
            out[name] = copy.deepcopy(v)
    return out


def _union(flat: dict, world: int) -> tuple[dict, set]:
    """Every rank's ``flat`` merged (a collective over the world): {name: value} where the ranks
    holding a name agree bitwise, and the set of names on which they disagree (DiLoCo replicas
    inside an interval; a state saved per rank under one global name)."""
    if world == 1:
        return flat, set()
    import torch.distributed as dist

    parts = [None] * world
    dist.all_gather_object(parts, flat)
    merged, conflicts = {}, set()
    for part in parts:
        for name, v in part.items():
            if name in merged and not _same(merged[name], v):
                conflicts.add(name)
            merged.setdefault(name, v)
    return merged, conflicts


def _gather(obj, world: int) -> list:
    """``obj`` of every rank, in rank order (a collective over the world)."""
    if world == 1:
        return [obj]
    import torch.distributed as dist

    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _same(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return (torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b))
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def _state(r, world: int) -> tuple[dict, set]:
    """The run's whole state: its tensors (``Trainer.tensor_state``) and what the checkpoint's
    ``meta.json`` carries (step, LR schedule, sampler position, loss scale) under ``run.``."""
    tr = r.trainer
    run = {"step": tr.step_count, "scheduler": tr.scheduler.state_dict(), "sampler": r.sampler.state_dict()}
    if tr.scaler is not None:
        run["loss_scale"] = tr.scaler.state_dict()
    return _union({**_flat(tr.tensor_state()), **_flat(run, "run.")}, world)


def compare_rows(got: list[dict], want: list[dict], tol: float | None, first_step: int) -> str | None:
    """None when ``got`` equals ``want`` (``tol`` 0: bitwise; None: only finite), else the first
    difference (step, value, both numbers, relative difference)."""
    if len(got) != len(want):
        return f"{len(got)} steps, want {len(want)}"
    for s, (g, w) in enumerate(zip(got, want), first_step):
        if set(g) != set(w):
            return f"step {s}: values {sorted(g)} != {sorted(w)}"
        for k in w:
            a, b = g[k], w[k]
            if tol is None:
                if k == "loss" and not math.isfinite(a):
                    return f"step {s} loss {a!r} not finite"
                continue
            if math.isnan(a) and math.isnan(b):
                continue
            rel = abs(a - b) / max(abs(b), 1e-30) if math.isfinite(a - b) else math.inf
            if (tol == 0 and a != b) or rel > tol:
                return f"step {s} {k}: {a!r} vs {b!r} (rel {rel:.1e})"
    return None


def compare_states(got: dict, want: dict, tol: float | None, skip: set = frozenset()) -> str | None:
    """None when every entry of ``want`` (but ``skip``) is in ``got`` and equal (``tol`` 0: bitwise;
    else max |diff| <= tol * max |want| per tensor; None: finite), else how many differ, the worst
    one and its largest difference."""
    bad, worst = [], (0.0, "")
    for name, w in want.items():
        if name in skip:
            continue
        if name not in got:
            bad.append(name)
            worst = worst if worst[1] else (math.inf, f"{name} missing")
            continue
        g = got[name]
        if not torch.is_tensor(w):
            if tol is not None and not _same(g, w):  # (bf16 / fp16: layouts may skip other steps)
                bad.append(name)
                worst = max(worst, (math.inf, f"{name}: {g!r} vs {w!r}"))
            continue
        if not torch.is_tensor(g) or g.shape != w.shape:
            bad.append(name)
            worst = max(worst, (math.inf, f"{name}: shape {tuple(getattr(g, 'shape', ()))} vs {tuple(w.shape)}"))
            continue
        if tol is None:
            ok = bool(torch.isfinite(g.double()).all()) if g.is_floating_point() else True
            diff = 0.0 if ok else math.inf
        else:
            diff = float((g.double() - w.double()).abs().max()) if g.numel() else 0.0
            scale = float(w.double().abs().max()) if w.numel() else 0.0
            ok = (torch.equal(g, w) if tol == 0 else diff <= tol * max(scale, 1e-30))
        if not ok:
            bad.append(name)
            worst = max(worst, (diff, f"{name}: max |diff| {diff:.3g}"))
    if not bad:
        return None
    return f"{len(bad)} of {len(want) - len(skip & set(want))} state entries differ; worst {worst[1]}"


def _verdict(rows_msg: str | None, state_msg: str | None, prefix: str = "") -> dict:
    msgs = [m for m in (rows_msg, state_msg and f"final state: {state_msg}") if m]
    return {"status": "mismatch" if msgs else "pass", "detail": prefix + "; ".join(msgs)}


def run_resume(combo: Combo, world: int, workdir: Path) -> dict:
    """U, R and O of ``combo`` on this rank (see the module docstring); the verdicts
    ``{"same": {"status", "detail"}, "other": ... | None, "other_layout": key}``. Collective."""
    from ndtrain.mesh import ParallelDims
    from ndtrain.train import loop

    cfg = resume_config(combo)
    k, n, table = cfg.training.stop_at_step, cfg.training.steps, _table()
    mesh = ParallelDims.from_config(cfg.parallel, world).build_mesh()
    u = _new_run(cfg, world, mesh, workdir / "u")
    rows_u = []
    for s in range(1, n + 1):
        rows_u.append(_step(u, table))
        if s == k:
            loop._save(u, s)  # the run loop's save (async: the write proceeds while U trains on)
            state_k, conflicts_k = _state(u, world)
    if u.saver is not None:
        u.saver.wait()
    final_u, _ = _state(u, world)
    path = u.ckpt_root / f"step_{k:08d}"
    r = _new_run(cfg, world, mesh, workdir / "r")
    loop._resume(r, path)
    rows_r = [_step(r, table) for _ in range(k, n)]
    final_r, _ = _state(r, world)
    out = {"same": _verdict(compare_rows(rows_r, rows_u[k:], 0.0, k + 1), compare_states(final_r, final_u, 0.0)),
           "other": None, "other_layout": ""}
    other = other_layout(combo)
    if other is not None:
        out["other_layout"] = other.key
        try:  # DCP raises on every rank at once (its CheckpointException gathers them)
            out["other"] = _resume_other(other, combo, world, path, mesh, rows_u, state_k, conflicts_k, final_u, k, n)
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            last = (str(e).strip().splitlines() or [""])[-1]
            out["other"] = {"status": "error", "detail": f"{type(e).__name__}: {last}"[:400]}
    return out


def _resume_other(other: Combo, combo: Combo, world: int, path: Path, mesh, rows_u, state_k, conflicts_k,
                  final_u, k: int, n: int) -> dict:
    """O of ``run_resume``: the checkpoint at ``path`` loaded into layout ``other``, checked, trained on."""
    from ndtrain.mesh import ParallelDims
    from ndtrain.train import loop

    table, cfg_b = _table(), resume_config(other)
    o = _new_run(cfg_b, world, ParallelDims.from_config(cfg_b.parallel, world).build_mesh(), path.parents[2] / "o")
    loop._resume(o, path)
    loaded, _ = _state(o, world)
    load_msg = compare_states(loaded, state_k, 0.0, skip=conflicts_k)
    rows_o = [_step(o, table) for _ in range(k, n)]
    final_o, _ = _state(o, world)
    tol = TOLERANCE.get(combo.dtype)
    # DiLoCo reports per-replica values (each replica's own gradient norm): against the same
    # replica of U (both layouts keep dp_replicate); otherwise every rank reports the global ones
    want = rows_u
    if cfg_b.training.local_sgd_steps:
        by_rep = dict(reversed(_gather((mesh.group("dp_replicate").rank, rows_u), world)))
        want = by_rep[o.mesh.group("dp_replicate").rank]
    v = _verdict(compare_rows(rows_o, want[k:], tol, k + 1), compare_states(final_o, final_u, tol))
    if load_msg:
        v = {"status": "mismatch", "detail": f"state after loading: {load_msg}" + (f"; {v['detail']}" if v["detail"] else "")}
    return v


def clean(workdir: Path) -> None:
    shutil.rmtree(workdir, ignore_errors=True)


def judge(outs: list[dict]) -> tuple[str, str, dict]:
    """Combine every rank's ``run_resume`` verdicts: (status, detail, extra). ``pass`` only when
    both parts pass on every rank; else ``mismatch`` (``error`` when a part raised) with the first
    rank's failing part."""
    extra = {"other_layout": outs[0]["other_layout"]}
    details = []
    for part in ("same", "other"):
        bad = [(rk, o[part]) for rk, o in enumerate(outs) if o[part] and o[part]["status"] != "pass"]
        extra[part] = "none" if outs[0][part] is None else ("fail" if bad else "pass")
        if bad:
            rk, v = bad[0]
            where = "same layout" if part == "same" else f"other layout ({extra['other_layout']})"
            details.append(f"{where}, rank {rk}: {v['detail']}")
    errored = any(o[p] and o[p]["status"] == "error" for o in outs for p in ("same", "other"))
    return ("error" if errored else "mismatch" if details else "pass"), " | ".join(details), extra


# ---------------------------------------------------------------------------------------------
# which combinations


def _extra(**kw) -> tuple:
    return tuple(sorted(kw.items()))


def resume_extras() -> list[Combo]:
    """Combinations only the resume sweep adds: DiLoCo (``training.local_sgd_steps`` 2) stopped at
    an outer boundary and inside an interval, asynchronous saves under DDP / ZeRO 1-3 / tp / pp /
    ep, and a float16 loss scale that moves every step."""
    dl = {"training.local_sgd_steps": 2}
    mid = {**dl, "training.stop_at_step": 3}
    asy = {"checkpoint.async_save": True}
    fp16 = {"training.loss_scale_growth_interval": 1}
    rows = [("dense", 2, {"dp_replicate": 2}, 0, dl), ("dense", 2, {"dp_replicate": 2}, 0, mid),
            ("dense", 4, {"dp_replicate": 2, "tp": 2}, 0, dl), ("dense", 4, {"dp_replicate": 2, "tp": 2}, 0, mid),
            ("dense", 4, {"dp_replicate": 2, **_PP1}, 0, dl), ("dense", 4, {"dp_replicate": 2, "dp_shard": 2}, 0, mid),
            ("hybrid", 4, {"dp_replicate": 2, "cp": 2, "cp_impl": "ring"}, 0, dl),
            ("mtp", 2, {"dp_replicate": 2}, 0, mid)]
    rows += [("dense", 2, {"dp_shard": 2}, z, asy) for z in (0, 1, 2, 3)]
    rows += [("dense", 2, {"tp": 2, "sequence_parallel": True}, 0, asy), ("moe", 2, {"dp_shard": 2, "ep": 2}, 1, asy),
             ("dense", 2, _PP1, 0, asy), ("dense", 1, {}, 0, asy)]
    out = [make_combo(f, w, par, "resume", zero=z, extra=_extra(**x)) for f, w, par, z, x in rows]
    out += [make_combo(f, 2, {"dp_shard": 2}, "resume", zero=z, dtype="float16", extra=_extra(**fp16))
            for f in ("dense", "moe") for z in (0, 3)]
    return out


# the default suite's share (tests/integration/test_sweep.py), 2 ranks: each axis once, DiLoCo at
# a boundary and inside an interval, asynchronous saves under DDP and ZeRO, the float16 loss scale,
# the expert bias (MoE), MTP, the linear-family mixers and Muon
_SUB = [("dense", {"dp_shard": 2}, {"zero": 2}), ("dense", {"tp": 2}, {"zero": 0}),
        ("moe", {"dp_shard": 2, "ep": 2}, {"zero": 3}), ("hybrid", {"cp": 2, "cp_impl": "ring"}, {"zero": 1}),
        ("mtp", {"pp": 2, "pp_schedule": "1f1b", "pp_virtual_stages": 1}, {"zero": 0}),
        ("muon", {"dp_shard": 2}, {"zero": 3})]  # Muon momenta resharded from ZeRO-3 row blocks


def resume_subset() -> list[Combo]:
    out = [make_combo(f, 2, par, "subset", **kw) for f, par, kw in _SUB]
    keep = {"dense | dp_replicate2 | zero0 | ac=none | float64 | local_sgd_steps=2",
            "dense | dp_replicate2 | zero0 | ac=none | float64 | local_sgd_steps=2 | stop_at_step=3",
            "dense | dp_shard2 | zero0 | ac=none | float64 | async_save=true",
            "dense | dp_shard2 | zero3 | ac=none | float64 | async_save=true",
            "moe | dp_shard2 | zero0 | ac=none | float16 | loss_scale_growth_interval=1"}
    return out + [c for c in resume_extras() if c.key in keep]

