"""Unit-level checks of the context-parallel mixers, run inside the ranks of
``tests/parallel/test_mixers_cp.py``: each mixer on its contiguous shard (``apply_cp``'s hooks
installed by hand) against the same module on the whole sequence, forward and backward.

Reference: the unsharded module in the same process, float64. Outputs and input gradients are
compared on this rank's positions, parameter gradients after a sum over the cp group. The
algebra is exact, so the bound is 1e-10 relative (rounding only).
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from ndtrain.config.schema import ModelConfig
from ndtrain.mesh import ParallelDims
from ndtrain.model.mixers import build_mixer
from ndtrain.model.rope import rope_tables
from ndtrain.parallel.cp.context_parallel import _install_core, local_positions
from ndtrain.parallel.cp.state_passing import StatePasser
from ndtrain.parallel.cp.window import WindowContextParallel
from tests.utils import rel_err, tiny_config

B, T, C = 2, 16, 32
KINDS = ("linear", "mamba2", "gated_deltanet", "sliding_window")


def _mcfg() -> ModelConfig:
    return tiny_config({"model.dim": C, "model.n_layers": 1, "model.rope_theta": 500000.0},
                       model={"linear_chunk_size": 3, "linear_heads": 2, "linear_key_head_dim": 8,
                              "linear_value_heads": 4, "linear_value_head_dim": 8, "linear_conv_kernel": 4,
                              "mamba_state_dim": 8, "mamba_head_dim": 8, "swa_window": 4}).model


def theory_bytes(kind: str, n: int, rank: int) -> float:
    """Bytes this rank sends on cp for one forward + backward of ``kind`` (float64, the dims of
    ``_mcfg``): the states' all-gather and their gradients' reduce-scatter, (n-1) x the packed
    per-rank state each way (``state_passing``), plus the neighbour exchange of W-1 = 3 conv inputs
    or w-1 = 3 keys and values, sent forward by every rank but the last and backward by every rank
    but the first (``window``)."""
    packed = {"linear": B * 4 * (8 * 9 + 1), "mamba2": B * 8 * (8 * 8 + 1),  # B H (K V + 1)
              "gated_deltanet": B * 4 * 8 * (8 + 8), "sliding_window": 0}[kind]  # B H K (K + V)
    halo = {"linear": 0, "mamba2": 3 * B * (64 + 2 * 8), "gated_deltanet": 3 * B * (2 * 16 + 32),
            "sliding_window": 2 * 3 * B * 2 * 8}[kind]  # (W-1) B Ch, or 2 (w-1) B G D
    sends = (rank < n - 1) + (rank > 0)
    return 8.0 * (2 * (n - 1) * packed + sends * halo)


def _one(kind: str, group) -> tuple[float, float]:
    """Worst relative error of ``kind`` on cp ``group`` against the whole sequence, and the bytes
    this rank sent on cp."""
    cfg = _mcfg()
    torch.manual_seed(0)
    ref = build_mixer(cfg, "0", kind).double()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.3)
    cos, sin = rope_tables(cfg)
    cos, sin = cos[:T].double(), sin[:T].double()
    x = torch.randn(B, T, C, dtype=torch.float64, requires_grad=True)
    gout = torch.randn(B, T, C, dtype=torch.float64)
    y = ref(x, cos, sin)
    (y * gout).sum().backward()
    cp = copy.deepcopy(ref)
    cp.zero_grad()
    if kind == "sliding_window":
        _install_core(cp, WindowContextParallel(group, cp.window))
    else:
        cp.__dict__["state_passer"] = StatePasser(group)
    pos = local_positions(T, group.size, group.rank, "contiguous")
    xl = x.detach()[:, pos].requires_grad_()
    sent = group.stats.get("cp", 0.0)
    yl = cp(xl, cos[pos], sin[pos])
    (yl * gout[:, pos]).sum().backward()
    sent = group.stats.get("cp", 0.0) - sent
    errs = [rel_err(yl, y[:, pos]), rel_err(xl.grad, x.grad[:, pos])]
    for (name, p), (_, q) in zip(ref.named_parameters(), cp.named_parameters()):
        g = q.grad.clone()
        dist.all_reduce(g, group=group.pg)
        errs.append(rel_err(g, p.grad))
    return max(errs), sent


def unit_checks(rank: int, world: int) -> dict[str, tuple[float, float, float]]:
    """{"<kind>/cp<n>": (worst relative error, bytes sent, ``theory_bytes``)} for every mixer under
    cp = world and cp = world / 2 (x dp_shard 2)."""
    out = {}
    for dims in (ParallelDims(cp=world, world_size=world), ParallelDims(dp_shard=2, cp=world // 2, world_size=world)):
        group = dims.build_mesh().group("cp")
        for kind in KINDS:
            err, sent = _one(kind, group)
            out[f"{kind}/cp{group.size}"] = (err, sent, theory_bytes(kind, group.size, group.rank))
    return out
