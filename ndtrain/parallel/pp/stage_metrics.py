"""MoE / MTP metrics of a pipeline-parallel step, combined over the stages.

Each pp stage holds a disjoint subset of the MoE layers (and only the head's stage the MTP
modules), so ``ExtraLosses.end_step`` sees its own stage's share. The aux-loss-free bias update
stays local (a layer's bias and its load counts live on one stage, the counts already reduced over
``dp_cp``); the logged values are combined over ``pp`` into the single process's:

* sums over layers (``aux_*_sum``, ``aux_loss``, MTP losses, ``moe_a2a_bytes``): summed;
* maxima over layers (``*_max``, ``*_worst``): the maximum;
* means over layers (``moe_load_max_mean``, ``moe_tokens_per_expert_mean``, ``moe_dropped_frac``
  -- every layer routes the same B T k assignments, so the dropped fraction is a per-layer mean
  too): weighted by each stage's MoE layer count.

One all-gather of the metric names and two all-reduces over ``pp`` per step (one SUM, one MAX,
a few float64 values each).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ndtrain.mesh import AxisGroup
from ndtrain.parallel import comm

SUMMED = ("aux_", "mtp_loss", "moe_a2a_bytes")


def _kind(key: str) -> str:
    if key.startswith(SUMMED) or key.endswith(("_sum", "_bytes")):
        return "sum"
    if key.endswith(("_max", "_worst")):
        return "max"
    return "mean"


def combine_over_stages(out: dict[str, float], n_moe_layers: int, group: AxisGroup,
                        device: torch.device | str = "cpu") -> dict[str, float]:
    """``out`` (this stage's metrics; ``n_moe_layers``: the MoE layers it counted) combined over
    the pp ``group`` as described in the module docstring; a stage without MoE layers reports no
    load metrics and contributes zero weight. Returns a new dict with every key some stage
    reported, the same on every pp rank. Collective over ``group`` (one object all-gather of the
    key names, then the two all-reduces)."""
    if group.size == 1:
        return dict(out)
    keys = sorted({k for names in comm.all_gather_object(sorted(out), group) for k in names})
    n = float(n_moe_layers)
    summed = torch.tensor([n, *[float(k in out) for k in keys],
                           *[out.get(k, 0.0) * (n if _kind(k) == "mean" else 1.0) for k in keys]],
                          dtype=torch.float64, device=device)
    peaks = torch.tensor([out.get(k, float("-inf")) for k in keys], dtype=torch.float64, device=device)
    comm.all_reduce(summed, group)
    comm.all_reduce(peaks, group, op=dist.ReduceOp.MAX)
    total, seen, values = summed[0].item(), summed[1:1 + len(keys)], summed[1 + len(keys):]
    res = {}
    for i, k in enumerate(keys):
        if seen[i] == 0:
            continue
        kind = _kind(k)
        if kind == "max":
            res[k] = peaks[i].item()
        elif kind == "mean":
            res[k] = values[i].item() / max(total, 1.0)
        else:
            res[k] = values[i].item()
    return res
