"""The Trainer's extra loss terms: MoE auxiliary losses, multi-token prediction, MoE bookkeeping.

Loss of one optimizer step (every term a token-weighted mean over the *global* batch, so data-
parallel gradients are summed, never averaged -- see ``ndtrain.train.loop``):

    loss_total = CE_main / n_valid
               + sum_layers (a_switch * S_switch + a_seq * S_seq + a_z * S_z) / n_routed
               + mtp_loss_weight / D * sum_k CE_k / n_valid_k

``n_valid`` / ``n_valid_k``: valid labels of the global batch for the main head / MTP depth k
(labels[:, k:]); ``n_routed``: routed tokens of the global batch (B x T); ``S_*``: the token-sum
forms of ``ndtrain.model.moe_balance`` (whose docstring states the statistics scope). The logged
``loss`` stays the main cross-entropy (comparable with dense runs); ``aux_loss`` and ``mtp_loss``
are logged next to it. After the optimizer step, ``end_step`` all-reduces the MoE load statistics
over dp_cp, applies the aux-loss-free bias update (not on a skipped step), and returns the load
metrics: tokens per expert and per ep rank (max / mean), the peak memory of the busiest rank
(``moe_peak_mem_bytes_max``, max over every rank: one scalar all-reduce per step) and
``moe_routing`` ("learned" | "balanced", ``training.moe_routing``, on every row so a forced-balanced
figure is never mistaken for a real one).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ndtrain.config import Config
from ndtrain.fault.bad_steps import world_group
from ndtrain.mesh import Mesh
from ndtrain.model import moe_balance
from ndtrain.model.mtp import mtp_loss_sums, mtp_valid_counts
from ndtrain.parallel import comm
from ndtrain.train.metrics import peak_memory_bytes


class ExtraLosses:
    """Per-step state of the extra terms for one rank.

    Args: cfg, the rank's model (after parallelize), mesh, device. Use:
    ``begin_step(inputs, labels)`` once with the rank's local batch, ``micro_loss(labels_mb)`` after
    each microbatch forward (returns the term to add to the microbatch loss before backward, a
    0-d tensor or 0.0), ``end_step(applied)`` after the optimizer step (returns metrics).
    """

    def __init__(self, cfg: Config, model: torch.nn.Module, mesh: Mesh, device: torch.device):
        self.cfg, self.model, self.mesh, self.device = cfg, model, mesh, device
        self.depth = cfg.model.mtp_depth
        self.group = mesh.group("dp_cp")
        self.stage_metrics = None  # pp > 1: the metric combiner over stages, built on first use
        self.world = world_group(mesh)  # the busiest rank's memory is a max over every rank
        for moe in moe_balance.moe_layers(model):  # forced-balanced routing for benchmarks (moe_capacity)
            moe.routing = cfg.training.moe_routing
        # MTP logits under tensor parallel are vocab-parallel (B, T', Vp / tp): the batch plan's loss
        self.loss_sum = None
        if self.depth and mesh.group("tp").size > 1:
            from ndtrain.parallel.batch import BatchPlan

            self.loss_sum = BatchPlan(mesh, cfg).loss_sum

    def _shift(self):
        """The model's ``mtp_shift`` hook (sequence / context parallel; ``ndtrain.model.mtp``)."""
        return getattr(self.model, "mtp_shift", None)

    def begin_step(self, inputs: torch.Tensor, labels: torch.Tensor) -> None:
        """Global counts: routed tokens and valid labels per MTP depth (one all-reduce)."""
        valid = mtp_valid_counts(labels, self.depth, shift=self._shift())  # collective under cp
        counts = torch.tensor([float(inputs.numel())] + [float(c) for c in valid],
                              dtype=torch.float64, device=self.device)
        comm.all_reduce(counts, self.group)
        self.n_routed = max(counts[0].item(), 1.0)
        self.mtp_denoms = [max(c, 1.0) for c in counts[1:].tolist()]
        self.acc = torch.zeros(1 + self.depth, dtype=torch.float64, device=self.device)  # aux, mtp_k

    def micro_loss(self, labels: torch.Tensor):
        total = 0.0
        aux = moe_balance.pop_aux_loss(self.model)
        if aux is not None:
            term = aux / self.n_routed
            self.acc[0] += term.detach().double()
            total = total + term
        mtp_logits = getattr(self.model, "mtp_logits", None) or []
        if mtp_logits:
            w = self.cfg.model.mtp_loss_weight / self.depth
            sums = mtp_loss_sums(mtp_logits, labels, shift=self._shift(), loss_sum=self.loss_sum)
            for k, s in enumerate(sums):
                term = s / self.mtp_denoms[k]
                self.acc[1 + k] += term.detach().double()
                total = total + w * term
            self.model.mtp_logits = []
        return total

    def end_step(self, applied: bool = True) -> dict[str, float]:
        """The step's metrics; the aux-loss-free expert-bias update only when the optimizer step
        was ``applied`` (a skipped step changes no state). Collective over dp_cp (and pp)."""
        comm.all_reduce(self.acc, self.group)
        out: dict[str, float] = {}
        n_moe = sum(m.stats.counts is not None for m in moe_balance.moe_layers(self.model))
        if self.cfg.model.is_moe:
            out["aux_loss"] = self.acc[0].item()
            reduce = (lambda t: comm.all_reduce(t, self.group)) if self.group.size > 1 else None
            rate = self.cfg.model.moe_bias_update_rate if applied else 0.0
            for k, v in moe_balance.end_step(self.model, reduce, rate, self.mesh.dims.ep).items():
                if k.endswith("_sum"):  # unweighted aux term, summed over MoE layers, per routed token
                    k, v = k[:-4], v / self.n_routed
                out[k] = v
        if self.depth:
            per_depth = self.acc[1:].tolist()
            out["mtp_loss"] = sum(per_depth) / self.depth
            out.update({f"mtp_loss_{k + 1}": v for k, v in enumerate(per_depth)})
        if self.mesh.dims.pp > 1:  # each stage saw its own layers (and the head's stage MTP): combine
            if self.stage_metrics is None:
                from ndtrain.parallel.pp.stage_metrics import StageMetrics

                self.stage_metrics = StageMetrics(self.mesh.group("pp"), self.device)
            out = self.stage_metrics.combine(out, n_moe)
        if self.cfg.model.is_moe:  # after the stage combine, which takes numbers only
            out["moe_peak_mem_bytes_max"] = comm.all_reduce_scalar(
                float(peak_memory_bytes(self.device)), self.world, op=dist.ReduceOp.MAX, device=self.device)
            out["moe_routing"] = self.cfg.training.moe_routing
        return out
