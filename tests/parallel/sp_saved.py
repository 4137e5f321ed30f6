"""What tp2 + SP saves for backward, measured (``torch.autograd.graph.saved_tensors_hooks``): the
column-parallel linears save this rank's (B, T/tp, C) shard and all-gather it again in backward
(``ndtrain.parallel.tp.sp_linear``) against the reference path that keeps the gathered (B, T, C)
input (``sp_linear.REGATHER = False``). Run inside a tp2 spawn group (``tests/parallel/test_tp.py``)."""
from __future__ import annotations

import torch

from ndtrain.mesh import ParallelDims
from ndtrain.model import build_model
from ndtrain.parallel.tp import sp_linear
from ndtrain.parallel.tp.tensor_parallel import apply_tp
from tests.parallel.layout_parity import global_batch, tiny_cfg


def _storages(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a tensor saved twice counts once)."""
    seen = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _run(cfg, mesh, tokens: torch.Tensor, regather: bool) -> dict:
    """One float64 forward / backward; saved bytes (whole model, block 0), grads, backward tp bytes."""
    sp_linear.REGATHER = regather
    try:
        model = build_model(cfg.model, dtype=torch.float64)
        apply_tp(model, mesh, sequence_parallel=True)
        packed, block = [], []
        inside = [False]

        def pack(t):
            packed.append(t)
            if inside[0]:
                block.append(t)
            return t

        blk = model.layers["0"]
        blk.register_forward_pre_hook(lambda *a: inside.__setitem__(0, True))
        blk.register_forward_hook(lambda *a: inside.__setitem__(0, False))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = model(tokens)  # (B, T, Vp/tp)
        w = torch.linspace(-1, 1, logits.numel(), dtype=logits.dtype).view_as(logits)
        mesh.reset_stats()
        (logits * w).sum().backward()
        tp_bytes = mesh.reset_stats().get("tp", 0.0)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        return {"saved": _storages(packed), "block": _storages(block), "grads": grads, "tp_bytes": tp_bytes}
    finally:
        sp_linear.REGATHER = True


def sp_saved_check(rank: int, world: int) -> dict:
    """Saved bytes and backward tp bytes of both paths, the worst relative grad difference, and the
    sizes the test's formulas need (L blocks, B, T, C, tp)."""
    cfg = tiny_cfg(world, tp=2, sequence_parallel=True)
    mesh = ParallelDims.from_config(cfg.parallel, world).build_mesh()
    tokens = global_batch(0)[0]  # (B, T): every tp rank sees the same batch
    old, new = (_run(cfg, mesh, tokens, r) for r in (False, True))
    diff = max(((new["grads"][n] - g).abs().max() / g.abs().max().clamp_min(1e-300)).item()
               for n, g in old["grads"].items())
    keys = ("saved", "block", "tp_bytes")
    return {"old": {k: old[k] for k in keys}, "new": {k: new[k] for k in keys}, "grad_diff": diff,
            "dims": (cfg.model.n_layers, *tokens.shape, cfg.model.dim, mesh.group("tp").size)}
