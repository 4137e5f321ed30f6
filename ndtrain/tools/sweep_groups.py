"""Run sweep combinations (``ndtrain.tools.sweep``) on gloo process groups, one group per world size,
and judge each against the single-process reference (``compare``, tolerances in ``ndtrain.tools.sweep``).

One spawned group trains many combinations in turn (spawning is the expensive part: a torch import
per rank). Ranks never use a collective to agree on how a combination ended, since after a failure
a collective could pair with a peer's pending one: each rank writes its outcome to a file and waits
for its peers' files. If any rank failed, every rank exits and the parent starts a fresh group at
the next combination; when a rank failed and its peers have not reported ``FAILED_GRACE_S`` later
(they wait in a collective the failed rank never reaches), the parent records the error and kills
the group without waiting for the hang timeout; a group that makes no progress for ``timeout_s``
(a hang: one rank waits in a collective its peers never reach) is killed, the combination recorded
as ``timeout``, and a fresh group continues. Process groups a combination created are destroyed
after it, and a rank whose thread count still grows past ``MAX_THREADS`` makes the parent start a
fresh group too.

``ndtrain.spawn`` (the package's launcher) returns only when every rank has ended; the sweep needs
each combination's outcome as it lands, to tell a hang from a long group and to go on after it.
"""
from __future__ import annotations

import datetime
import gc
import json
import math
import os
import shutil
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from ndtrain.spawn import free_port, stop_processes
from ndtrain.tools.sweep import TOLERANCE, Combo, build_config, make_combo, train_steps

_REF: dict = {}


def reference(feature: str, dtype: str) -> list[dict[str, float]]:
    """Single-process run (world 1, ZeRO 0, no activation checkpointing) of ``feature`` in ``dtype``;
    cached per process."""
    if (feature, dtype) not in _REF:
        combo = make_combo(feature, 1, {}, dtype=dtype)
        _REF[(feature, dtype)] = train_steps(build_config(combo), 1)
    return _REF[(feature, dtype)]


def _write(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)  # a reader never sees half a file


def compare(combo: Combo, ranks: list[list[dict]], ref: list[dict]) -> tuple[str, float, str]:
    """Judge one trained combination from every rank's per-step values.

    Returns (status, worst relative difference to the reference, detail): ``pass`` (within
    ``TOLERANCE[dtype]`` on every rank), ``mismatch``, ``runs`` (bf16 / fp16: finite loss on every
    rank) or ``nonfinite``.
    """
    tol = TOLERANCE.get(combo.dtype)
    worst, where, over = 0.0, "", set()
    for r, rows in enumerate(ranks):
        if len(rows) != len(ref):
            return "mismatch", math.inf, f"rank {r}: {len(rows)} steps, reference {len(ref)}"
        for s, (got, want) in enumerate(zip(rows, ref)):
            if set(got) != set(want):
                return "mismatch", math.inf, f"rank {r} step {s + 1}: values {sorted(got)} != {sorted(want)}"
            for k, w in want.items():
                g = got[k]
                if math.isnan(g) or math.isnan(w):  # nan only matches nan (fp16 skipped steps)
                    rel = 0.0 if math.isnan(g) and math.isnan(w) else math.inf
                else:
                    rel = abs(g - w) / max(abs(w), 1e-30)
                if tol is not None and rel > tol:
                    over.add(k)
                if rel > worst or (rel == math.inf and not where):
                    worst, where = rel, f"rank {r} step {s + 1} {k}: {g!r} vs {w!r}"
    if tol is not None:
        if worst <= tol:
            return "pass", worst, where
        return "mismatch", worst, f"{where} (rel {worst:.1e}); over {tol:g}: {', '.join(sorted(over))}"
    finite = all(math.isfinite(row["loss"]) for rows in ranks for row in rows)
    return ("runs" if finite else "nonfinite"), worst, where


@dataclass
class Result:
    """Outcome of one combination: ``status`` is rejected | pass | mismatch | runs | nonfinite |
    error | timeout; ``detail`` the rule, the worst difference or the traceback's last lines."""

    combo: Combo
    status: str
    rel: float = float("nan")
    detail: str = ""
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)


MAX_THREADS = 300  # a rank above this many native threads asks for a fresh group (see _run_one)
# after a rank reported an error, how long its peers may take to report theirs (a peer that raised
# too writes within a second or two; one stuck in a collective with the failed rank never does)
FAILED_GRACE_S = 5.0


def _native_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))  # gloo's threads are invisible to ``threading``
    except OSError:
        return threading.active_count()


def _run_one(combo: Combo, world: int, mode: str = "layout", workdir: Path | None = None) -> dict:
    """Train one combination on this rank; the outcome as a JSON-able dict (``ok``, ``rows`` (mode
    ``layout``) or ``verdict`` (mode ``resume``: ``ndtrain.tools.resume_sweep.run_resume`` with its
    checkpoints under ``workdir``) or ``error`` / ``tb``, ``seconds``, ``threads``)."""
    import torch.distributed as dist

    c10d = dist.distributed_c10d
    before = set(c10d._world.pg_map) if world > 1 else set()
    t0 = time.perf_counter()
    try:
        if mode == "resume":
            from ndtrain.tools.resume_sweep import run_resume

            out = {"ok": True, "verdict": run_resume(combo, world, workdir)}
        else:
            out = {"ok": True, "rows": train_steps(build_config(combo), world)}
    except BaseException as e:  # noqa: BLE001 - any failure of the combination is a result
        tb = traceback.format_exc().strip().splitlines()
        out = {"ok": False, "error": f"{type(e).__name__}: {e}"[:600], "tb": "\n".join(tb[-12:])}
    out["seconds"] = time.perf_counter() - t0
    if out["ok"] and world > 1:  # clean up only after a clean combination (no pending collectives)
        gc.collect()  # the Trainer's reference cycles keep its process groups (and their threads) alive
        for pg in set(c10d._world.pg_map) - before:
            if pg is not dist.GroupMember.WORLD:
                dist.destroy_process_group(pg)
        gc.freeze()  # what survived is long-lived (modules, caches): the next collect skips it
    # what is still left (DeviceMesh caches, pipeline receivers) accumulates threads over hundreds
    # of combinations, and a few thousand idle gloo threads slow every process on the machine
    out["threads"] = _native_threads()
    return out


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:  # a killed sweep leaves no ranks behind
        time.sleep(1.0)
    os._exit(1)


def _worker(rank: int, world: int, port: int, out_dir: str, gen: int, combos: list[dict],
            timeout_s: float, parent: int, mode: str = "layout") -> None:
    import torch
    import torch.distributed as dist

    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
    out = Path(out_dir)
    for k, c in enumerate(combos):
        workdir = out / f"g{gen}_c{k}_ckpt"
        res = _run_one(Combo.from_dict(c), world, mode, workdir)
        _write(out / f"g{gen}_c{k}_r{rank}.json", res)
        peers = [out / f"g{gen}_c{k}_r{r}.json" for r in range(world)]
        while not all(p.exists() for p in peers):  # the parent kills the group on a hang
            time.sleep(0.005)
        if rank == 0:  # every rank is done with this combination's checkpoints
            shutil.rmtree(workdir, ignore_errors=True)
        outs = [json.loads(p.read_text()) for p in peers]
        # every rank reads the same files, so all take the same decision
        if not all(o["ok"] for o in outs) or max(o["threads"] for o in outs) > MAX_THREADS:
            break  # a failed rank may leave collectives pending: the parent starts a fresh group
    os._exit(0)  # no teardown collectives: they could hang after a failure


def _judge(combo: Combo, outs: list[dict | None], mode: str = "layout") -> Result:
    """``outs``: each rank's outcome, None for a rank that never reported (stuck behind a failure)."""
    secs = max(o["seconds"] for o in outs if o is not None)
    failed = [(r, o) for r, o in enumerate(outs) if o is not None and not o["ok"]]
    if failed:
        r, o = failed[0]
        extra = {"traceback": o["tb"], "failed_ranks": [r for r, _ in failed]}
        stuck = [r for r, o in enumerate(outs) if o is None]
        if stuck:
            extra["stuck_ranks"] = stuck
        return Result(combo, "error", detail=f"rank {r}: {o['error']}", seconds=secs, extra=extra)
    if mode == "resume":
        from ndtrain.tools.resume_sweep import judge

        status, detail, extra = judge([o["verdict"] for o in outs])
        return Result(combo, status, detail=detail, seconds=secs, extra=extra)
    status, rel, where = compare(combo, [o["rows"] for o in outs], reference(combo.feature, combo.dtype))
    return Result(combo, status, rel, where, secs)


def run_group(world: int, combos: list[Combo], timeout_s: float = 120.0, log=print,
              mode: str = "layout") -> list[Result]:
    """Train ``combos`` (all of world size ``world``) on as few gloo groups as failures allow;
    return one ``Result`` per combination, in order. ``timeout_s``: the longest a combination may
    run before its group is declared hung. ``log(result)`` is called as each one ends. ``mode``:
    ``layout`` (judged against the single-process reference) or ``resume`` (stopped and resumed:
    ``ndtrain.tools.resume_sweep``)."""
    import torch.multiprocessing as mp

    for c in combos if mode == "layout" else ():  # references first, in this process (world 1)
        reference(c.feature, c.dtype)
    results: list[Result] = []
    todo, gen = list(combos), 0
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        while todo:
            dicts, port = [c.to_dict() for c in todo], free_port()
            args = (world, port, tmp, gen, dicts, timeout_s, os.getpid(), mode)
            procs = [ctx.Process(target=_worker, args=(r, *args), daemon=True) for r in range(world)]
            for p in procs:
                p.start()
            done, state = _watch(procs, Path(tmp), gen, todo, timeout_s, results, log, mode)
            # a finished group is exiting by itself; a hung or broken one is killed at once
            stop_processes(procs, grace_s=0.0 if state in ("timeout", "stuck") else 5.0)
            if state in ("timeout", "crash"):
                reported = [r for r in range(world) if (Path(tmp) / f"g{gen}_c{done}_r{r}.json").exists()]
                detail = (f"no progress in {timeout_s:.0f} s" if state == "timeout" else
                          f"exit codes {[p.exitcode for p in procs]}") + f"; ranks that finished: {reported}"
                results.append(Result(todo[done], state, detail=detail))
                log(results[-1])
                done += 1
            todo, gen = todo[done:], gen + 1
    return results


def _watch(procs, tmp: Path, gen: int, todo: list[Combo], timeout_s: float, results: list, log,
           mode: str = "layout"):
    """Collect the outcomes of group ``gen`` as they appear. Returns (combinations finished, how the
    group ended: "done" | "restart" (a failure, or too many threads) | "stuck" (a failure whose
    peers never reported: kill the group) | "timeout" | "crash")."""
    world, done, last, failed_at = len(procs), 0, time.monotonic(), None
    while done < len(todo):
        alive = any(p.is_alive() for p in procs)  # sampled first: a rank writes, then exits
        files = [tmp / f"g{gen}_c{done}_r{r}.json" for r in range(world)]
        outs = [json.loads(f.read_text()) if f.exists() else None for f in files]  # os.replace: whole files
        if all(o is not None for o in outs):
            results.append(_judge(todo[done], outs, mode))
            log(results[-1])
            done, last, failed_at = done + 1, time.monotonic(), None
            if not all(o["ok"] for o in outs) or max(o["threads"] for o in outs) > MAX_THREADS:
                return done, "restart"  # the ranks exit by themselves (same rule as _worker)
        elif any(o is not None and not o["ok"] for o in outs):
            failed_at = failed_at or time.monotonic()
            if time.monotonic() - failed_at > FAILED_GRACE_S:
                results.append(_judge(todo[done], outs, mode))
                log(results[-1])
                return done + 1, "stuck"
            time.sleep(0.02)
        elif not alive:
            return done, "crash"
        elif time.monotonic() - last > timeout_s:
            return done, "timeout"
        else:
            time.sleep(0.02)
    return done, "done"
