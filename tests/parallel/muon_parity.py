"""Harness of the sharded-Muon parity tests: a tiny model trained 10 steps with
``training.optimizer: muon`` under a layout and, inside the same rank, as one process on the whole
global batch (``layout_parity``'s dense model; the ``moe_debug`` preset for expert parallel).

Compared: every step's loss, the final parameters and the final Muon momenta and AdamW moments,
read through the checkpoint adapter (``Trainer.tensor_state``: global names, whole tensors), all
in float64 to 1e-8 relative. The layouts only reorder float64 sums (gradient reductions), so the
Newton-Schulz inputs agree to ~1e-15 and, because each matrix is orthogonalised whole, so do the
updates. Also recorded: the bytes each axis moved inside the orthogonalisation (``muon_bytes``),
the owner plan, and, on step 0, each Muon matrix's Nesterov update and orthogonalised result as
this rank holds them (``ortho``), for the per-slice check.
"""
from __future__ import annotations

import torch

from ndtrain.config import validate
from ndtrain.config.load import load_config
from ndtrain.mesh import ParallelDims
from ndtrain.train.loop import Trainer
from tests.parallel import layout_parity as lp

STEPS = 10
G = lp.G


def muon_cfg(kind: str, world: int, **par):
    """``kind`` "dense" / "tied" (``layout_parity.tiny_cfg``, untied / tied embeddings), "moe" (``moe_debug``) or "hybrid"
    (``hybrid_debug``: Gated DeltaNet mixers with fused projections, MoE), the presets in float64,
    10 steps, microbatches of the ep layouts' local batch so Switch statistics cover the same tokens."""
    micro = par.pop("micro", 0)
    if kind in ("dense", "tied"):
        cfg = lp.tiny_cfg(world, micro, tie=kind == "tied", **par)
    else:
        preset = {"moe": "moe_debug", "hybrid": "hybrid_debug"}[kind]
        cfg = load_config(preset, {"training.dtype": "float64", "training.steps": STEPS,
                                        "training.global_batch_size": G, "training.micro_batch_size": micro or 2,
                                        "training.grad_clip": 0.05, "data.seq_len": lp.T,
                                        "parallel.bucket_size_bytes": 4096,
                                        **{f"parallel.{k}": v for k, v in par.items()}})
    t = cfg.training
    t.optimizer, t.muon_momentum, t.lr, t.weight_decay = "muon", 0.9, 1e-2, 0.1
    validate(cfg, world)
    return cfg


def batch(kind: str, step: int):
    """``layout_parity.global_batch`` (its ids are valid in ``moe_debug``'s larger vocabulary)."""
    return lp.global_batch(step)


def _whole(t) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _state(tr: Trainer) -> dict[str, torch.Tensor]:
    """``{"param:<fqn>" / "<key>:<fqn>": whole tensor}`` from the checkpoint adapter."""
    st = tr.tensor_state()
    out = {f"param:{n}": _whole(t) for n, t in st["model"].items() if torch.is_tensor(t) and t.dim() > 0}
    for n, s in st["optim"]["state"].items():
        out.update({f"{k}:{n}": _whole(v) for k, v in s.items() if k != "step"})
    return out


def _names(tr: Trainer) -> dict[int, str]:
    if hasattr(tr.dp, "entries"):
        return {id(e.param): e.fqn for e in tr.dp.entries}
    return {id(p): n for n, p in tr.model.named_parameters()}


def _instrument(tr: Trainer, rec: dict) -> None:
    """Record the orthogonalisation's bytes per axis every step, and step 0's inputs / outputs."""
    f, names, stats = tr.optimizer.orthogonalize, _names(tr), tr.mesh.stats
    rec["inner"] = f

    def wrapped(params, updates, steps):
        before = dict(stats)
        out = f(params, updates, steps)
        rec["muon_bytes"].append({a: stats.get(a, 0.0) - before.get(a, 0.0) for a in stats
                                  if stats.get(a, 0.0) != before.get(a, 0.0)})
        if "ortho" not in rec:
            rec["ortho"] = {names[id(p)]: (u.clone(), o.clone()) for p, u, o in zip(params, updates, out)}
        return out

    tr.optimizer.orthogonalize = wrapped


_REF: dict = {}


def reference(kind: str, micro: int = 0) -> dict:
    """The single-process run (cached per process); ``micro`` matters for "moe" only (the
    microbatches the layout's ranks see: Switch statistics)."""
    key = (kind, micro if kind in ("moe", "hybrid") else 0)
    if key not in _REF:
        tr = Trainer(muon_cfg(kind, 1, micro=key[1]), ParallelDims(world_size=1).build_mesh(), torch.device("cpu"))
        rec = {"muon_bytes": [], "ns_flops": tr.optimizer.ns_flops_per_step()}
        _instrument(tr, rec)
        outs = [tr.step(*batch(kind, s)) for s in range(STEPS)]
        rec["loss"], rec["grad_norm"] = [o["loss"] for o in outs], [o["grad_norm"] for o in outs]
        rec["state"] = _state(tr)
        _REF[key] = rec
    return _REF[key]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def run(rank: int, world: int, layouts: dict) -> dict:
    """Each ``{name: (kind, parallel keys)}`` layout next to its reference; per layout the worst
    relative differences ``loss`` / ``state`` (worst key in ``worst``), ``muon_bytes`` per step,
    the owner plan, step 0's ``ortho`` and the reference's."""
    results = {}
    for name, (kind, par) in layouts.items():
        cfg = muon_cfg(kind, world, **dict(par))
        mesh = ParallelDims.from_config(cfg.parallel, world).build_mesh()
        tr = Trainer(cfg, mesh, torch.device("cpu"))
        ref = reference(kind, dict(par).get("micro", 0))
        rec = {"muon_bytes": [], "ns_flops": tr.optimizer.ns_flops_per_step()}
        _instrument(tr, rec)
        dp = mesh.group("dp")
        local = G // dp.size
        sl = slice(dp.rank * local, (dp.rank + 1) * local)
        loss = 0.0
        for s in range(STEPS):
            inputs, labels = batch(kind, s)
            d = tr.step(inputs[sl], labels[sl])
            loss = max(loss, abs(d["loss"] - ref["loss"][s]) / abs(ref["loss"][s]))
        mine = _state(tr)
        diffs = {k: _rel(v, ref["state"][k]) for k, v in mine.items()}
        worst = max(diffs, key=diffs.get)
        orth = rec["inner"]
        results[name] = {"loss": loss, "state": diffs[worst], "worst": worst, "n_state": len(diffs),
                         "muon_bytes": rec["muon_bytes"], "ortho": rec["ortho"], "ref_ortho": ref["ortho"],
                         "owners": dict(orth.owners), "sizes": _sizes(tr),
                         "ns_flops": rec["ns_flops"], "ref_ns_flops": ref["ns_flops"],
                         "ref_grad_norm": ref["grad_norm"],
                         "mesh": {a: (mesh.group(a).size, mesh.group(a).rank) for a in ("dp_shard_cp", "tp", "pp", "ep")}}
    return results


def _sizes(tr: Trainer) -> dict[str, int]:
    """Padded block elements s_j of every entry (ZeRO / FSDP), from the layout itself."""
    if not hasattr(tr.dp, "entries"):
        return {}
    return {e.fqn: e.layout.sizes[e.index] for e in tr.dp.entries}


def assert_parity(res: list[dict], tol: float = 1e-8) -> None:
    """Every layout within ``tol`` of its reference on every rank, with clipping active (the
    reference's gradient norm above ``training.grad_clip`` = 0.05 on every step)."""
    for r in res:
        for name, v in r.items():
            assert v["loss"] < tol and v["state"] < tol, (name, v["loss"], v["worst"], v["state"])
            assert v["n_state"] > 0
            assert min(v["ref_grad_norm"]) > 0.05, (name, v["ref_grad_norm"])


def resume(rank: int, world: int, ckpt_dir: str, src: dict, dst: dict, save_at: int = 5, kind: str = "dense") -> dict:
    """``src`` trains ``save_at`` steps and saves a checkpoint; ``dst`` (another layout on the same
    ranks) loads it and trains the rest. Returns the worst relative differences to the
    uninterrupted single-process run (losses of the resumed steps, final state) and the path."""
    from pathlib import Path

    from ndtrain.checkpoint import dcp as ckpt

    micro = src.get("micro", 0)
    ref = reference(kind, micro)
    trs = []
    for par in (src, dst):
        cfg = muon_cfg(kind, world, **dict(par))
        trs.append(Trainer(cfg, ParallelDims.from_config(cfg.parallel, world).build_mesh(), torch.device("cpu")))
    a, b = trs
    losses = [_local_step(a, s, kind) for s in range(save_at)]
    path = ckpt.save_checkpoint(Path(ckpt_dir), save_at, a.tensor_state(),
                                {"step": save_at, "scheduler": a.scheduler.state_dict()})
    state = b.tensor_state()
    meta = ckpt.load_checkpoint(path, state)
    b.load_tensor_state(state)
    b.scheduler.load_state_dict(meta["scheduler"])
    losses += [_local_step(b, s, kind) for s in range(save_at, STEPS)]
    diffs = {k: _rel(v, ref["state"][k]) for k, v in _state(b).items()}
    worst = max(diffs, key=diffs.get)
    loss = max(abs(x - y) / abs(y) for x, y in zip(losses, ref["loss"]))
    return {"loss": loss, "state": diffs[worst], "worst": worst, "n_state": len(diffs), "path": str(path)}


def _local_step(tr: Trainer, s: int, kind: str) -> float:
    dp = tr.mesh.group("dp")
    local = G // dp.size
    inputs, labels = batch(kind, s)
    return tr.step(inputs[dp.rank * local:(dp.rank + 1) * local], labels[dp.rank * local:(dp.rank + 1) * local])["loss"]


def resume_one_process(path: str, save_at: int = 5, kind: str = "dense", micro: int = 0) -> dict:
    """The checkpoint resumed in one plain process: worst relative differences as ``resume``."""
    from pathlib import Path

    from ndtrain.checkpoint import dcp as ckpt

    ref = reference(kind, micro)
    tr = Trainer(muon_cfg(kind, 1, micro=micro), ParallelDims(world_size=1).build_mesh(), torch.device("cpu"))
    state = tr.tensor_state()
    meta = ckpt.load_checkpoint(Path(path), state)
    tr.load_tensor_state(state)
    tr.scheduler.load_state_dict(meta["scheduler"])
    losses = [tr.step(*batch(kind, s))["loss"] for s in range(save_at, STEPS)]
    diffs = {k: _rel(v, ref["state"][k]) for k, v in _state(tr).items()}
    worst = max(diffs, key=diffs.get)
    loss = max(abs(x - y) / abs(y) for x, y in zip(losses, ref["loss"][save_at:]))
    return {"loss": loss, "state": diffs[worst], "worst": worst, "n_state": len(diffs)}


def diloco_twin(rank: int, world: int, steps: int = 6, h: int = 2) -> float:
    """DiLoCo (dp_replicate 2, H = ``h``, outer Nesterov lr 0.7 / momentum 0.9) with Muon as the
    inner optimizer against two single-process Muon trainers (one per replica, same half batches)
    and the outer step written out (``tests/parallel/test_diloco.py``'s AdamW twin). Returns the
    worst relative weight difference at the end."""
    def build(w: int, **par) -> Trainer:
        cfg = muon_cfg("dense", w, **par)
        if w > 1:
            cfg.training.local_sgd_steps, cfg.training.outer_lr, cfg.training.outer_momentum = h, 0.7, 0.9
            validate(cfg, w)
        return Trainer(cfg, ParallelDims.from_config(cfg.parallel, w).build_mesh(), torch.device("cpu"))

    dil = build(world, dp_replicate=2, dp_shard=1)
    reps = [build(1) for _ in range(2)]
    weights = lambda tr: {k: v.detach().clone() for k, v in tr.model.state_dict().items()}
    anchor = weights(reps[0])
    buf = {k: torch.zeros_like(v) for k, v in anchor.items()}
    half = G // 2
    for s in range(steps):
        x, y = batch("dense", s)
        dil.step(x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half])
        for r, tr in enumerate(reps):
            tr.step(x[r * half:(r + 1) * half], y[r * half:(r + 1) * half])
        if (s + 1) % h == 0:
            ws = [weights(tr) for tr in reps]
            for k in anchor:
                g = anchor[k] - (ws[0][k] + ws[1][k]) / 2
                buf[k] = g if s + 1 == h else 0.9 * buf[k] + g
                anchor[k] = anchor[k] - 0.7 * (g + 0.9 * buf[k])
            for tr in reps:
                tr.model.load_state_dict(anchor)
    got = weights(dil)
    return max(_rel(got[k], anchor[k]) for k in got if got[k].dim() > 0)
