"""Shared harness of the TP / SP / CP / 3-D parity tests: one tiny model trained 10 steps under a
layout and, inside the same rank, under a world-size-1 layout on the whole global batch.

Reference: the single-process ``Trainer`` (same seed, same global batch). Compared per step: the
loss, the gradient norm before clipping and every parameter's gradient as the optimizer sees it
(TP shards reassembled, padding dropped); at the end every parameter. Tolerance 1e-6 relative in
float64 (the issue's contract): the layouts only reorder floating-point sums (all-reduces, online
softmax merges, split matmuls), which stays near 1e-13 in float64 even after 10 AdamW steps.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ndtrain.config import Config
from ndtrain.mesh import ParallelDims
from ndtrain.parallel.cp.context_parallel import local_positions, resolve_layout
from ndtrain.parallel.tp.tensor_parallel import tp_full_tensor, tp_local_slice, tp_specs
from ndtrain.train.loop import IGNORE_INDEX, Trainer
from tests.utils import rel_err, tiny_config

V, T, G = 61, 16, 4  # vocab (not a multiple of 2 or 4: padding), sequence, global batch
STEPS = 10


def tiny_cfg(world: int = 1, micro: int = 0, n_kv_heads: int = 2, tie: bool = False, **par) -> Config:
    return tiny_config({"training.micro_batch_size": micro, "model.n_kv_heads": n_kv_heads,
                        "model.tie_embeddings": tie}, world=world, parallel={"dp_shard": -1, **par})


def global_batch(step: int, hole: tuple[int, str, int] | None = None):
    """(G, T) inputs and labels (labels already shifted by the data). About a third of the labels
    are masked; on step 3 ``hole = (cp, layout, rank)`` masks every label of that cp rank, so one
    shard holds no valid label at all."""
    g = torch.Generator().manual_seed(1000 + step)
    seq = torch.randint(0, V, (G, T + 1), generator=g)
    inputs, labels = seq[:, :-1], seq[:, 1:].clone()
    labels[torch.rand(G, T, generator=g) < 0.3] = IGNORE_INDEX
    if hole is not None and step == 3:
        cp, layout, rank = hole
        labels[:, local_positions(T, cp, rank, layout)] = IGNORE_INDEX
    return inputs, labels


def non_causal(trainer: Trainer) -> None:
    """Make every block attend bidirectionally (reference: SDPA without mask; ring: causal=False)."""
    for block in trainer.model.layers.values():
        core = block.attention.core
        if hasattr(core, "causal"):
            core.causal = False
        elif hasattr(core, "inner"):
            core.inner = _full_attention
        else:
            block.attention.core = _full_attention


def _full_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1])


def _named_grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    """What the optimizer is about to apply, by parameter name: whole (TP-local) gradients under
    plain data parallel, this rank's valid rows of each gradient under ZeRO / FSDP."""
    dp = trainer.dp
    if hasattr(dp, "entries"):
        return {e.fqn: e.valid(e.param.grad).detach().clone() for e in dp.entries if e.param.grad is not None}
    return {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def _expected_local(trainer: Trainer, name: str, full: torch.Tensor, tp) -> torch.Tensor:
    """The part of a reference (full) tensor that ``_named_grads`` holds on this rank."""
    local = tp_local_slice(full, tp_specs(trainer.model).get(name), tp)
    dp = trainer.dp
    if hasattr(dp, "entries"):
        e = next(e for e in dp.entries if e.fqn == name)
        return dp._local_rows(local, e)
    return local


def _full_param(trainer: Trainer, name: str, value, tp) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        value = value.full_tensor()
    return tp_full_tensor(value.detach(), tp_specs(trainer.model).get(name), tp)


def _record_grads(trainer: Trainer, sink: list) -> None:
    step = trainer.optimizer.step

    @functools.wraps(step)  # keeps the LR scheduler's marker attribute
    def wrapped(*a, **k):
        sink.append(_named_grads(trainer))
        return step(*a, **k)

    trainer.optimizer.step = wrapped


_REF_CACHE: dict = {}


def reference_run(causal: bool, hole, n_kv_heads: int, tie: bool) -> dict:
    """Single-process losses, grad norms, clipped gradients per step and final parameters (cached
    per process: many layouts of one spawn share it)."""
    key = (causal, hole, n_kv_heads, tie)
    if key not in _REF_CACHE:
        ref = Trainer(tiny_cfg(1, 0, n_kv_heads, tie), ParallelDims(world_size=1).build_mesh(),
                      torch.device("cpu"))
        if not causal:
            non_causal(ref)
        grads: list = []
        _record_grads(ref, grads)
        steps = [ref.step(*global_batch(s, hole)) for s in range(STEPS)]
        _REF_CACHE[key] = {"steps": steps, "grads": grads,
                           "params": {n: p.detach().clone() for n, p in ref.dp.model_state_dict().items()}}
    return _REF_CACHE[key]


def run_layout(rank: int, world: int, causal: bool = True, hole: bool = False, micro: int = 0,
               n_kv_heads: int = 2, tie: bool = False, **par) -> dict:
    """Train the layout ``par`` for 10 steps next to the single-process reference; return the worst
    relative differences (loss, grad norm, per-parameter gradients, final parameters), the per-axis
    bytes of every step, the reference grad norms and this rank's local parameter shapes."""
    cfg = tiny_cfg(world, micro, n_kv_heads, tie, **par)
    mesh = ParallelDims.from_config(cfg.parallel, world).build_mesh()
    tr = Trainer(cfg, mesh, torch.device("cpu"))
    if not causal:
        non_causal(tr)
    layout = resolve_layout(cfg.parallel.cp_impl, cfg.parallel.cp_layout)
    hole_spec = (mesh.dims.cp, layout, 0) if hole else None
    ref = reference_run(causal, hole_spec, n_kv_heads, tie)
    tr_g: list = []
    _record_grads(tr, tr_g)
    tp, dp = mesh.group("tp"), mesh.group("dp")
    out = {"loss": 0.0, "grad_norm": 0.0, "grad": 0.0, "param": 0.0, "bytes": [], "n_valid_local": []}
    local = G // dp.size
    for step in range(STEPS):
        inputs, labels = global_batch(step, hole_spec)
        r = ref["steps"][step]
        sl = slice(dp.rank * local, (dp.rank + 1) * local)
        mesh.reset_stats()
        d = tr.step(inputs[sl], labels[sl])
        out["bytes"].append(mesh.reset_stats())
        out["n_valid_local"].append(int((tr.plan.shard(inputs[sl], labels[sl])[1] != IGNORE_INDEX).sum()))
        out["loss"] = max(out["loss"], abs(r["loss"] - d["loss"]) / abs(r["loss"]))
        out["grad_norm"] = max(out["grad_norm"], abs(r["grad_norm"] - d["grad_norm"]) / r["grad_norm"])
        assert tr_g[step].keys() == ref["grads"][step].keys()
        for name, g in ref["grads"][step].items():
            out["grad"] = max(out["grad"], rel_err(tr_g[step][name], _expected_local(tr, name, g, tp)))
    for name, value in tr.dp.model_state_dict().items():
        out["param"] = max(out["param"], rel_err(_full_param(tr, name, value, tp), ref["params"][name]))
    out["ref_gn"] = [s["grad_norm"] for s in ref["steps"]]
    specs = tp_specs(tr.model)
    out["local_shapes"] = {n: tuple(p.shape) for n, p in tr.model.named_parameters()}
    out["n_params_local"] = sum(p.numel() for p in tr.model.parameters())
    out["tp_specs"] = specs
    return out


def assert_parity(res: list[dict], tol: float = 1e-6) -> None:
    """Every rank within ``tol`` of the reference; clipping was active (grad norm > 0.05)."""
    for r in res:
        for key in ("loss", "grad_norm", "grad", "param"):
            assert r[key] < tol, (key, r[key])
    assert res[0]["ref_gn"][0] > 0.05, "clipping should be active"


def theory_bytes(n_dp: int = 1, n_cp: int = 1, n_tp: int = 1, sp: bool = False, impl: str = "ring",
                 micro: int = 0, n_params_local: int = 0, n_kv_heads: int = 2) -> dict[str, float]:
    """Bytes each rank sends per step and axis for the tiny model (float64, L=2, C=32, H=4, D=8).

    tp: per microbatch the block halves' f / g pairs, the embedding and the output head move
    (8L + 4) * B*T*C elements as all-gather / reduce-scatter halves ((n-1)/n each; a non-SP
    all-reduce is two halves), under SP (2L + 1) * B*T*C more (each region's, and the head's,
    saved shard all-gathered again for the weight gradient), plus all-reduces of the vocab-parallel loss (3 B*T), the SP norm
    gains ((2L + 1) C), replicated kv weights (2 L G D C) and 1 clip scalar per step.
    cp ring: (cp-1) K/V blocks forward, (cp-1) K/V + cp dK/dV blocks backward, per layer.
    cp Ulysses: q, k, v and out through an all-to-all ((n-1)/n) in each direction, per layer.
    dp: one all-reduce of the local gradients over dp (dp_cp when cp > 1) + 4 scalars on dp_cp
    (valid labels with the batch-size agreement's B and B^2 in one all-reduce; the loss).
    world: the bad-step agreement, one all-reduce of one float32 flag per rank (fault.bad_steps);
    when dp x cp is the whole world, float64 flags with the loss folded in (not on dp_cp then).
    """
    L, C, H, D, b = 2, 32, 4, 8, 8
    B = G // n_dp
    m = B // (micro or B)
    Bm, Tl = B // m, T // n_cp
    out: dict[str, float] = {}
    if n_tp > 1:
        f = (n_tp - 1) / n_tp
        replicated = n_kv_heads % n_tp != 0
        ar = m * (3 * Bm * Tl + (2 * L + 1) * C * sp + replicated * 2 * L * n_kv_heads * D * C) + 1
        acts = 8 * L + 4 + (2 * L + 1) * sp  # SP: each region's shard all-gathered again in backward
        out["tp"] = f * b * m * Bm * Tl * C * acts + 2 * f * b * ar
    if n_cp > 1:
        hl = H // n_tp
        gl = n_kv_heads // n_tp if n_kv_heads % n_tp == 0 else 1
        if impl == "ring":
            out["cp"] = m * L * (3 * n_cp - 2) * 2 * Bm * gl * Tl * D * b
        else:
            gk = gl if gl % n_cp == 0 else hl
            out["cp"] = m * L * 2 * (n_cp - 1) / n_cp * b * Bm * Tl * D * (2 * hl + 2 * gk)
    n = n_dp * n_cp
    w = n * n_tp
    fold = w == n  # the loss group is the world: the loss rides in the bad-step all-reduce
    if n > 1:
        out["dp_cp" if n_cp > 1 else "dp"] = 2 * (n - 1) / n * b * n_params_local
        out["dp_cp"] = out.get("dp_cp", 0.0) + 2 * (n - 1) / n * (3 if fold else 4) * b
    if w > 1:
        out["world"] = 2 * (w - 1) / w * (8 * (w + 1) if fold else 4 * w)
    return out


def assert_bytes(res: list[dict], axes: tuple[str, ...] | None = None, **theory_kw) -> None:
    """Every step's counted bytes per axis equal ``theory_bytes`` exactly, on every rank (only on
    ``axes`` when given, e.g. under ZeRO / FSDP, whose own traffic is tested with them)."""
    for r in res:
        want = theory_bytes(n_params_local=r["n_params_local"], **theory_kw)
        if axes is not None:
            want = {a: want[a] for a in axes}
        for got in r["bytes"]:
            if axes is None:
                assert got.keys() == want.keys(), (got, want)
            for axis, v in want.items():
                assert got[axis] == v, (axis, got[axis], v)
