"""One rank's training state: ``Trainer(cfg, mesh, device)``, ``step(inputs, labels, documents=None)``,
``eval_loss``.

Loss convention (token-weighted): the loss of a step is the sum of the per-token cross-entropies over
all valid labels (label != -100) of the *global* batch, divided by the number of valid labels of the
global batch. Each microbatch backpropagates ``sum_ce / n_valid_global``; data-parallel gradients are
summed. Splitting a batch into microbatches or across ranks therefore gives the single-process
gradient exactly, even when ranks hold very different numbers of valid tokens, and a last
microbatch shorter than the others is just a microbatch with fewer tokens. MoE auxiliary losses and
MTP losses are added the same way (``ndtrain.train.extras``).

Everything layout-dependent comes from ``ndtrain.parallel.parallelize`` as one ``ParallelPlan``.
"""
from __future__ import annotations

import torch

from ndtrain.config import Config
from ndtrain.fault.bad_steps import (
    agree_bad_ranks,
    agree_bad_ranks_and_sum,
    inject_faults,
    is_finite,
    world_group,
)
from ndtrain.mem_account import MemorySampler, StateMemory, state_tensors
from ndtrain.mesh import Mesh
from ndtrain.optim import build_scheduler
from ndtrain.parallel import comm
from ndtrain.parallel.dp.grad_sync import max_over_mesh
from ndtrain.parallel.muon.sharded import build_train_optimizer
from ndtrain.parallel.parallelize import parallelize, param_dtype
from ndtrain.parallel.pp.observe import RuntimeObserver
from ndtrain.precision import build_loss_scaler, compute_dtype
from ndtrain.train.extras import ExtraLosses

IGNORE_INDEX = -100


class _ValidCount:
    """A step's global count of valid labels: known (``value``), or pending on an all-reduce in
    flight (``resolve``: waits and checks, may raise ValueError). ``denom()`` is the loss
    denominator ``max(count, 1)``: a float when known, else this object, which the pipeline
    runtime's ``loss_sum / denom`` resolves (``__rtruediv__``) after the first forward."""

    def __init__(self, value: float | None = None, resolve=None):
        self._value, self._resolve = value, resolve

    def value(self) -> float:
        if self._value is None:
            self._value, self._resolve = self._resolve(), None
        return self._value

    def denom(self):
        return max(self._value, 1.0) if self._value is not None else self

    def __float__(self) -> float:
        return max(self.value(), 1.0)

    def __rtruediv__(self, t):
        return t / float(self)


class _StateSampler(RuntimeObserver):
    """Samples the rank's state bytes (parameters, gradients, optimizer state) after every backward
    action of the step, where gradients of one more microbatch have just been accumulated."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer

    def on_action_end(self, a) -> None:
        if a.kind in ("B", "W"):
            tr = self.trainer
            tr.mem.sample(state_tensors(tr.model, tr.optimizer, tr.dp))


class Trainer:
    """One rank's training state. ``step(inputs, labels)`` runs one optimizer step on its local batch.

    Args:
        cfg: validated config.
        mesh: the layout (``ParallelDims(...).build_mesh()``); all ones works in a plain process.
        device: this rank's device.
    Attributes: ``plan`` (the ``ParallelPlan``), and for convenience its ``model``, ``dp`` (the
    ``GradSync``), ``pipeline`` and ``outer`` (the ``OuterSync``: DiLoCo or nothing); ``optimizer``,
    ``scheduler``, ``scaler`` (fp16), ``step_count``.

    Bad steps (``ndtrain.fault.bad_steps``): a non-finite local loss or gradient norm on any rank
    skips the step on every rank (one all-reduce over the world agrees; when the loss group is
    the world it also sums the loss, so ``_finish`` issues no second one). A skipped step -- bad,
    or an fp16 overflow -- leaves every state unchanged (weights, optimizer, LR schedule, the
    expert bias, the outer loop's counts); only the loss scale and the step counter move, so the
    batch is skipped. Test hooks (``bad_steps.inject_faults``),
    1-based steps firing once each: ``nan_steps`` (this rank's loss and a gradient become NaN),
    ``spike_steps`` (this rank's reported loss x 100); set them on one rank's instance, or on the
    class inside one rank's process, before the run.
    """

    nan_steps: frozenset = frozenset()
    spike_steps: frozenset = frozenset()

    def __init__(self, cfg: Config, mesh: Mesh, device: torch.device):
        self.cfg, self.mesh, self.device = cfg, mesh, device
        t = cfg.training
        self.param_dtype = param_dtype(cfg)
        self.autocast_dtype = compute_dtype(t.dtype)  # bf16 / fp16 autocast, None = off
        self.autocast = self.autocast_dtype is not None
        self.scaler = build_loss_scaler(t)  # fp16 dynamic loss scaling (ndtrain.precision)
        self.mem = StateMemory()  # per-rank bytes held (ndtrain.mem_account)
        self.measure_memory = False  # also meter activations / in-hook peaks on the next step
        self.activation_peak_bytes = 0  # of the last measured step (one microbatch, bytes)
        self.plan = parallelize(None, mesh, cfg, device)
        self.model, self.dp, self.pipeline = self.plan.model, self.plan.grad_sync, self.plan.pipeline
        self.outer = self.plan.outer  # DiLoCo's outer step (training.local_sgd_steps), or nothing
        # MoE auxiliary losses, MTP losses, expert-bias update (ndtrain.train.extras); None if dense
        self.extras = (ExtraLosses(cfg, self.model, mesh, device)
                       if cfg.model.is_moe or cfg.model.mtp_depth else None)
        self.optimizer = build_train_optimizer(self.dp, mesh, t)  # AdamW, or Muon (training.optimizer)
        self.scheduler = build_scheduler(self.optimizer, t)
        self.step_count = 0
        self.local_batch = t.global_batch_size // mesh.dims.dp
        self.pipeline.runtime.observers.append(_StateSampler(self))
        self.micro_batch = self.plan.micro_batch  # rows per microbatch of a one-stage step
        self.world = world_group(mesh)  # the bad-step agreement spans every rank
        self.loss_group = self.plan.loss_group  # one replica's ranks under DiLoCo
        # the loss group is the whole world (plain data parallel): the loss sum rides in the
        # bad-step agreement's all-reduce, one blocking collective per step instead of two
        self.fold_loss = self.world.size > 1 and self.mesh.group(self.loss_group).size == self.world.size
        # the batch agreement may overlap the first forward (``_agree_on_batch``) when that forward
        # has no data-parallel collectives to desynchronise (the plan says when)
        self.overlap_agree = self.plan.agree_overlaps_forward

    def _agree_on_batch(self, labels: torch.Tensor) -> _ValidCount:
        """Valid labels of the global batch, after checking that every dp x cp rank holds the same
        number of sequences -- in the same all-reduce (sum of B and of B^2: they are all equal iff
        n * sum(B^2) == sum(B)^2). Uneven local batches would desynchronise the per-microbatch
        collectives of ZeRO-2/3 (a size mismatch or a hang), so every rank raises the same
        ValueError instead. Raises ValueError also for an empty batch (on every rank). Under
        DiLoCo the same over one replica (``dp_shard_cp``).

        Blocking, before any forward, except under ``self.overlap_agree`` (plain DDP, one stage, no
        MoE: a forward without data-parallel collectives), where the all-reduce runs during the
        first microbatch's forward and is waited for at its ``loss_sum / denom`` (``_ValidCount``),
        so its latency is hidden; a rank with no sequences waits at once (it runs no forward), and
        every rank still raises before any gradient collective."""
        group = self.mesh.group(self.loss_group)
        b = float(labels.shape[0])
        stats = torch.tensor([float((labels != IGNORE_INDEX).sum()), b, b * b], dtype=torch.float64,
                             device=self.device)

        def check() -> float:
            n_valid, total, total_sq = stats.tolist()
            if group.size * total_sq != total * total:
                raise ValueError(f"local batch sizes differ across the {group.size} data-parallel x cp ranks "
                                 f"({total:.0f} sequences in all, mean {total / group.size:g}): every rank "
                                 f"must hold the same number of sequences (global_batch_size / dp)")
            if total == 0:
                raise ValueError("empty batch: every rank holds 0 sequences")
            return n_valid

        if not self.overlap_agree or group.size == 1 or b == 0:
            comm.all_reduce(stats, group)
            return _ValidCount(check())
        work = comm.all_reduce(stats, group, async_op=True)

        def resolve() -> float:
            work.wait()
            return check()
        return _ValidCount(resolve=resolve)

    def step(self, inputs: torch.Tensor, labels: torch.Tensor,
             documents: torch.Tensor | None = None) -> dict[str, float]:
        """One optimizer step on this rank's local batch. inputs, labels: (B_local, T) int64; any
        B_local >= 1, the same on every data-parallel rank (else ValueError on every rank).
        ``documents``: (B_local, T) int packed document ids (``data.document_mask``) or None.

        Returns ``loss`` (global token-weighted mean), ``grad_norm`` (before clipping), ``lr``,
        ``n_tokens`` (valid labels in the global batch); MoE / MTP models add ``aux_loss``,
        ``mtp_loss``, ``moe_load_max_mean``, ``moe_dropped_frac``... (``ExtraLosses.end_step``).
        """
        inputs, labels = inputs.to(self.device), labels.to(self.device)
        inputs, labels, positions, documents = self.plan.shard(inputs, labels, documents)  # this cp rank's
        count = self._agree_on_batch(labels)
        if self.extras is not None:
            self.extras.begin_step(inputs, labels)
        self.mem.reset()
        self.dp.observe_memory(MemorySampler(self.mem) if self.measure_memory else None)  # in-hook peaks
        runtime = self.pipeline.runtime
        runtime.track_memory = self.measure_memory
        self.pipeline.m = self.plan.microbatches(inputs.shape[0])
        loss_sum = self.pipeline.forward_backward(
            inputs, labels, count.denom(), positions,
            extra_loss=self.extras.micro_loss if self.extras is not None else None,
            loss_scale=self.scaler.scale if self.scaler is not None else 1.0, documents=documents)
        self.mem.sample(state_tensors(self.model, self.optimizer, self.dp))
        if self.nan_steps or self.spike_steps:  # test hooks (class docstring)
            loss_sum = inject_faults(self, loss_sum)
        out = self._update(loss_sum)
        if "loss_sum" in out:
            loss_sum = out.pop("loss_sum")  # already summed over the loss group
        out.update(self.mem.report())
        if self.measure_memory:  # live activation storages of the whole step on this stage
            self.activation_peak_bytes = runtime.peak_activation_bytes
        out["mem_activations_peak_bytes"] = self.activation_peak_bytes
        return self._finish(out, loss_sum, count.value())

    def _update(self, loss_sum: torch.Tensor) -> dict:
        """fp16 unscale (an overflow on any rank skips the step everywhere), clip, bad-step
        agreement, optimizer and LR step, zero the gradients. Returns ``grad_norm``, ``lr``,
        ``bad_step`` (+ ``bad_ranks``: world ranks with a non-finite loss / norm), ``applied``
        (the step was taken) and the loss-scale entries."""
        ok = True
        if self.scaler is not None:
            grads = [p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
            ok = self.scaler.unscale_and_check(grads, max_over_mesh(self.mesh))
            self.scaler.update(ok)
        grad_norm = self.dp.clip_grad_norm(self.cfg.training.grad_clip, self.mesh) if ok else float("nan")
        # an fp16 overflow is the loss scaler's business (ok False), not a bad step
        local_bad = not is_finite(loss_sum) or (ok and not is_finite(grad_norm))
        if self.fold_loss:
            bad_ranks, loss_total = agree_bad_ranks_and_sum(local_bad, loss_sum, self.world, self.device)
        else:
            bad_ranks = agree_bad_ranks(local_bad, self.world, self.device)
        ok = ok and not bad_ranks
        lr = self.optimizer.param_groups[0]["lr"]
        if ok:
            self.optimizer.step()
            self.scheduler.step()
        # the state peak: parameters, gradients and optimizer state all live
        self.mem.sample(state_tensors(self.model, self.optimizer, self.dp))
        self.optimizer.zero_grad(set_to_none=True)
        out = {"grad_norm": grad_norm, "lr": lr, "bad_step": bool(bad_ranks), "applied": ok}
        if self.fold_loss:
            out["loss_sum"] = loss_total
        if bad_ranks:
            out["bad_ranks"] = bad_ranks
        if self.scaler is not None:
            out.update({"loss_scale": self.scaler.scale, "skipped": not ok})
        return out

    def _finish(self, out: dict, loss_sum: torch.Tensor, n_valid: float) -> dict:
        """The step's loss (over the loss group; DiLoCo: the replicas' mean), then what follows an
        optimizer step only when it was taken (``applied``): the outer step, the expert-bias update."""
        if not self.fold_loss:
            comm.all_reduce(loss_sum, self.mesh.group(self.loss_group))
        self.step_count += 1
        applied = out.pop("applied")
        out.update({"loss": self.outer.step_loss(loss_sum.item() / max(n_valid, 1.0)), "n_tokens": n_valid})
        out.update(self.outer.after_step(applied))
        if self.extras is not None:  # aux / MTP losses, expert loads; aux-loss-free bias update
            out.update(self.extras.end_step(applied))
        return out

    @torch.no_grad()
    def eval_loss(self, batches) -> float:
        """Token-weighted mean loss over ``batches`` of (inputs, labels) or (inputs, labels, documents)
        local to this rank."""
        self.model.eval()
        tot = torch.zeros(2, dtype=torch.float64, device=self.device)
        for inputs, labels, *docs in batches:
            inputs, labels, positions, documents = self.plan.shard(inputs.to(self.device), labels.to(self.device),
                                                                   docs[0] if docs else None)
            extra = {} if documents is None else {"documents": documents}
            tot[0] += self.plan.eval_loss_sum(inputs, labels, positions, **extra)  # the same on every pp rank
            tot[1] += (labels != IGNORE_INDEX).sum()
        self.model.train()
        comm.all_reduce(tot, self.mesh.group("dp_cp"))
        return (tot[0] / tot[1].clamp(min=1)).item()

    def tensor_state(self) -> dict:
        """``{"model", "optim"}``: every tensor whole (or a DTensor of global shape) under its
        single-process name (``ndtrain.parallel.state``); the outer loop's state too (DiLoCo:
        ``"inner"``, per-replica ``"optim"``, ``"outer"``; ``ndtrain.parallel.dp.diloco``). Collective.
        Before the first step the optimizer stays fresh: torch's ``get_optimizer_state_dict`` makes
        a lazy optimizer's state by a zero-LR step, which would leave AdamW at step 1 (a fine-tune's
        first update, after ``init_weights_from`` read this template, 26% too small)."""
        fresh = not self.optimizer.state
        state = self.plan.state.state(self.optimizer)
        if fresh:  # the tree keeps its zero tensors as a template; the first step makes them anew
            self.optimizer.state.clear()
        return state

    def load_tensor_state(self, state: dict) -> None:
        """Load a tree shaped like ``tensor_state()`` (model, optimizer, outer loop). Collective."""
        self.plan.state.load(state, self.optimizer)

    def load_model_state(self, model_state: dict) -> None:
        """Weights only, shaped like ``tensor_state()["model"]`` (optimizer untouched). Collective.
        Under DiLoCo the loaded weights become the anchor."""
        self.plan.state.load_model(model_state)
        self.outer.weights_loaded()
