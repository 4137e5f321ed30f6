"""MoE / MTP metrics of a pipeline step, combined over the stages into the single process's.

Each stage sees only its layers' share; the bias update stays local. Sums over layers
(``aux_*_sum``, ``aux_loss``, MTP losses, ``moe_a2a_bytes``) are summed, maxima (``*_max``,
``*_worst``) maxed, means (``moe_load_max_mean``, ``moe_tokens_per_expert_mean``,
``moe_dropped_frac``) weighted by each stage's MoE layer count. Two all-reduces over pp per step."""
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


class StageMetrics:
    """Combines a stage's metrics over ``group`` each step. The union of metric names is gathered once;
    later steps flag a change in the MAX all-reduce they run anyway, and on a flag every rank
    re-gathers and repeats, so no key is dropped and collectives never mismatch."""

    def __init__(self, group: AxisGroup, device: torch.device | str = "cpu"):
        self.group, self.device = group, device
        self.keys: list[str] | None = None  # union over the stages
        self.mine: list[str] | None = None  # this rank's names when the union was gathered
        self.gathers = 0

    def combine(self, out: dict[str, float], n_moe_layers: int) -> dict[str, float]:
        """``out`` (this stage's metrics over ``n_moe_layers``) combined over the stages: every key some
        stage reported, the same on every pp rank."""
        if self.group.size == 1:
            return dict(out)
        mine = sorted(out)
        for _ in range(2):
            if self.keys is None:
                self.keys = sorted({k for names in comm.all_gather_object(mine, self.group) for k in names})
                self.mine, self.gathers = mine, self.gathers + 1
            res, changed = _reduce(out, n_moe_layers, self.keys, mine != self.mine, self.group, self.device)
            if not changed:
                return res
            self.keys = None  # some stage's names changed: every rank re-gathers
        raise RuntimeError("pp stage metric names changed twice within one step")


def combine_over_stages(out: dict[str, float], n_moe_layers: int, group: AxisGroup,
                        device: torch.device | str = "cpu") -> dict[str, float]:
    """One step of ``StageMetrics`` without a cache (gathers the names every call)."""
    return StageMetrics(group, device).combine(out, n_moe_layers)


def _reduce(out: dict[str, float], n_moe_layers: int, keys: list[str], changed: bool, group: AxisGroup,
            device) -> tuple[dict[str, float], bool]:
    """The step's SUM and MAX all-reduces over ``keys``: (combined metrics, whether any rank flagged
    ``changed``)."""
    n = float(n_moe_layers)
    summed = torch.tensor([n, *[float(k in out) for k in keys],
                           *[out.get(k, 0.0) * (n if _kind(k) == "mean" else 1.0) for k in keys]],
                          dtype=torch.float64, device=device)
    peaks = torch.tensor([float(changed), *[out.get(k, float("-inf")) for k in keys]],
                         dtype=torch.float64, device=device)
    comm.all_reduce(summed, group)
    comm.all_reduce(peaks, group, op=dist.ReduceOp.MAX)
    if peaks[0].item() > 0:
        return {}, True
    total, seen, values = summed[0].item(), summed[1:1 + len(keys)], summed[1 + len(keys):]
    res = {}
    for i, k in enumerate(keys):
        if seen[i] == 0:
            continue
        kind = _kind(k)
        if kind == "max":
            res[k] = peaks[1 + i].item()
        elif kind == "mean":
            res[k] = values[i].item() / max(total, 1.0)
        else:
            res[k] = values[i].item()
    return res, False
