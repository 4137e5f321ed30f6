"""The training loop: build -> parallelize -> step -> log -> checkpoint.

Loss convention (token-weighted): the loss of a step is the sum of the per-token cross-entropies over
all valid labels (label != -100) of the *global* batch, divided by the number of valid labels of the
global batch. Each microbatch backpropagates ``sum_ce / n_valid_global``; data-parallel gradients are
summed. Splitting a batch into microbatches or across ranks therefore gives the single-process
gradient exactly, even when ranks hold very different numbers of valid tokens. MoE auxiliary
losses and MTP losses are added the same way (``ndtrain.train_extras``).
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ndtrain import checkpoint as ckpt
from ndtrain import metrics
from ndtrain.config import Config, save_config
from ndtrain.mem_account import ActivationMeter, StateMemory, state_tensors
from ndtrain.mesh import Mesh, ParallelDims, device_for_rank
from ndtrain.model import build_model
from ndtrain.optim import build_scheduler
from ndtrain.parallel import comm
from ndtrain.parallel.parallelize import build_batch_plan, parallelize
from ndtrain.parallel.pp.pipeline import flatten_param_groups, unflatten_param_groups
from ndtrain.parallel.tp.state import gather_tp_state, scatter_tp_state
from ndtrain.precision import build_loss_scaler, compute_dtype
from ndtrain.train_extras import ExtraLosses

IGNORE_INDEX = -100


class Trainer:
    """One rank's training state. ``step(inputs, labels)`` runs one optimizer step on its local batch.

    Args:
        cfg: validated config.
        mesh: the layout (``ParallelDims(...).build_mesh()``); all ones works in a plain process.
        device: this rank's device.
    """

    def __init__(self, cfg: Config, mesh: Mesh, device: torch.device):
        self.cfg, self.mesh, self.device = cfg, mesh, device
        t = cfg.training
        self.param_dtype = torch.float64 if t.dtype == "float64" else torch.float32
        self.autocast_dtype = compute_dtype(t.dtype)  # bf16 / fp16 autocast, None = off
        self.autocast = self.autocast_dtype is not None
        self.scaler = build_loss_scaler(t)  # fp16 dynamic loss scaling (ndtrain.precision)
        self.mem = StateMemory()  # per-rank bytes held (ndtrain.mem_account)
        self.measure_memory = False  # also meter activations / in-hook peaks on the next step
        self.activation_peak_bytes = 0  # of the last measured step (one microbatch, bytes)
        if mesh.dims.pp > 1:  # only this rank's pipeline stage, built on meta (ndtrain.parallel.pp.stage)
            from ndtrain.parallel.pp.stage import build_pipeline_stage

            self.model = build_pipeline_stage(cfg, mesh, device, self.param_dtype, t.seed)
        else:
            self.model = build_model(cfg.model, device, self.param_dtype, t.seed)
        self.dp = parallelize(self.model, mesh, cfg)
        self.plan = build_batch_plan(mesh, cfg)  # cuts batches for cp, vocab-parallel loss for tp
        # MoE auxiliary losses, MTP losses, expert-bias update (ndtrain.train_extras); None if dense
        self.extras = (ExtraLosses(cfg, self.model, mesh, device)
                       if cfg.model.is_moe or cfg.model.mtp_depth else None)
        self.optimizer = self.dp.build_optimizer(t)
        self.scheduler = build_scheduler(self.optimizer, t)
        self.step_count = 0
        dims = mesh.dims
        self.local_batch = t.global_batch_size // dims.dp
        self.micro_batch = t.micro_batch_size or self.local_batch
        self.pipeline = None  # pp > 1: step() hands the microbatches to the pipeline schedule
        if dims.pp > 1:
            from ndtrain.parallel.pp.pipeline import StagePipeline

            n_micro = cfg.parallel.pp_microbatches or self.local_batch // self.micro_batch
            self.pipeline = StagePipeline(
                self.model, self.dp, mesh, cfg, lambda lg, y: self.plan.loss_sum(lg.to(self.param_dtype), y),
                lambda: (torch.autocast(device.type, dtype=self.autocast_dtype) if self.autocast
                         else contextlib.nullcontext()), device, n_micro)

    def _forward_loss_sum(self, inputs: torch.Tensor, labels: torch.Tensor,
                          positions: torch.Tensor | None = None) -> torch.Tensor:
        """Sum of token cross-entropies of a microbatch. inputs, labels: (B, T); positions (T,)."""
        ctx = (torch.autocast(self.device.type, dtype=self.autocast_dtype) if self.autocast
               else contextlib.nullcontext())
        with ctx:
            logits = self.model(inputs, positions)  # (B, T, V), or (B, T, V / tp) under tp
        if logits.dtype != self.param_dtype:
            logits = logits.to(self.param_dtype)
        return self.plan.loss_sum(logits, labels)

    def step(self, inputs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """One optimizer step on this rank's local batch. inputs, labels: (B_local, T) int64.

        Returns ``loss`` (global token-weighted mean), ``grad_norm`` (before clipping), ``lr``,
        ``n_tokens`` (valid labels in the global batch); MoE / MTP models add ``aux_loss``,
        ``mtp_loss``, ``moe_load_max_mean``, ``moe_dropped_frac``... (``ExtraLosses.end_step``).
        """
        inputs, labels = inputs.to(self.device), labels.to(self.device)
        inputs, labels, positions = self.plan.shard(inputs, labels)  # this cp rank's tokens
        dp_cp = self.mesh.group("dp_cp")
        n_valid = comm.all_reduce_scalar(float((labels != IGNORE_INDEX).sum()), dp_cp,
                                         device=self.device)
        denom = max(n_valid, 1.0)
        if self.pipeline is not None:
            return self._pipeline_step(inputs, labels, positions, n_valid)
        if self.extras is not None:
            self.extras.begin_step(inputs, labels)
        n_micro = inputs.shape[0] // self.micro_batch
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.mem.reset()
        if hasattr(self.dp, "mem"):  # sample inside the data-parallel hooks too
            self.dp.mem = self.mem if self.measure_memory else None
        act_peak = 0
        for i in range(n_micro):
            sl = slice(i * self.micro_batch, (i + 1) * self.micro_batch)
            last = i == n_micro - 1
            meter = (ActivationMeter(self.model.parameters()) if self.measure_memory and i == 0
                     else contextlib.nullcontext())
            with contextlib.nullcontext() if last else self.dp.no_sync(), meter:
                ls = self._forward_loss_sum(inputs[sl], labels[sl], positions)
                loss = ls / denom
                if self.extras is not None:
                    loss = loss + self.extras.micro_loss(labels[sl])
                (loss * self.scaler.scale if self.scaler else loss).backward()
            act_peak = max(act_peak, getattr(meter, "peak", 0))
            self.mem.sample(state_tensors(self.model, self.optimizer, self.dp))
            loss_sum += ls.detach().double()
        self.dp.finish_grad_sync()
        self.mem.sample(state_tensors(self.model, self.optimizer, self.dp))
        ok = True
        if self.scaler is not None:  # fp16: unscale; an overflow on any rank skips the step everywhere
            grads = [p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
            ok = self.scaler.unscale_and_check(grads, self.mesh)
            self.scaler.update(ok)
        grad_norm = self.dp.clip_grad_norm(self.cfg.training.grad_clip, self.mesh) if ok else float("nan")
        lr = self.optimizer.param_groups[0]["lr"]
        if ok:
            self.optimizer.step()
            self.scheduler.step()
        self.mem.sample(state_tensors(self.model, self.optimizer, self.dp))
        self.optimizer.zero_grad(set_to_none=True)
        comm.all_reduce(loss_sum, dp_cp)
        self.step_count += 1
        out = {"loss": loss_sum.item() / denom, "grad_norm": grad_norm, "lr": lr, "n_tokens": n_valid}
        out.update(self.mem.report())
        if self.measure_memory:
            self.activation_peak_bytes = act_peak
        out["mem_activations_peak_bytes"] = self.activation_peak_bytes
        if self.scaler is not None:
            out.update({"loss_scale": self.scaler.scale, "skipped": not ok})
        if self.extras is not None:  # aux / MTP losses, expert loads; aux-loss-free bias update
            out.update(self.extras.end_step())
        return out

    def _pipeline_step(self, inputs, labels, positions, n_valid: float) -> dict[str, float]:
        """``step`` under pipeline parallel: the schedule runs every microbatch (DP sync after the
        last, tied-embedding grads summed), then global-norm clipping over all stages."""
        denom = max(n_valid, 1.0)
        scale = self.scaler.scale if self.scaler is not None else 1.0  # fp16: loss scaled by S
        self.pipeline.runtime.track_memory = self.measure_memory
        loss_sum = self.pipeline.forward_backward(inputs, labels, denom / scale, positions)
        ok = True
        if self.scaler is not None:  # unscale; an overflow on any rank of any stage skips the step
            grads = [p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
            ok = self.scaler.unscale_and_check(grads, self.mesh)
            self.scaler.update(ok)
        grad_norm = self.pipeline.clip_grad_norm(self.cfg.training.grad_clip) if ok else float("nan")
        lr = self.optimizer.param_groups[0]["lr"]
        if ok:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        comm.all_reduce(loss_sum, self.mesh.group("dp_cp"))
        self.step_count += 1
        out = {"loss": loss_sum.item() / denom, "grad_norm": grad_norm, "lr": lr, "n_tokens": n_valid}
        if self.measure_memory:  # live activation storages of the whole step on this stage
            out["mem_activations_peak_bytes"] = self.pipeline.runtime.peak_activation_bytes
        if self.scaler is not None:
            out.update({"loss_scale": self.scaler.scale, "skipped": not ok})
        return out

    @torch.no_grad()
    def eval_loss(self, batches) -> float:
        """Token-weighted mean loss over ``batches`` of (inputs, labels) local to this rank."""
        self.model.eval()
        tot = torch.zeros(2, dtype=torch.float64, device=self.device)
        for inputs, labels in batches:
            inputs, labels, positions = self.plan.shard(inputs.to(self.device), labels.to(self.device))
            if self.pipeline is not None:  # the last stage's loss, summed over pp (all ranks agree)
                tot[0] += self.pipeline.eval_loss_sum(inputs, labels, positions)
            else:
                tot[0] += self._forward_loss_sum(inputs, labels, positions).double()
            tot[1] += (labels != IGNORE_INDEX).sum()
        self.model.train()
        comm.all_reduce(tot, self.mesh.group("dp_cp"))
        return (tot[0] / tot[1].clamp(min=1)).item()

    def tensor_state(self) -> dict:
        # optimizer groups keyed by parameter name, tied head as the embedding (ndtrain.parallel.pp.pipeline)
        optim = flatten_param_groups(self.dp.optim_state_dict(self.optimizer), self.model)
        state = {"model": self.dp.model_state_dict(), "optim": optim}
        return gather_tp_state(state, self.model, self.mesh)  # TP-split tensors whole (global names)

    def load_tensor_state(self, state: dict) -> None:
        template = self.dp.optim_state_dict(self.optimizer)
        state = {**state, "optim": unflatten_param_groups(state["optim"], template, self.model)}
        state = scatter_tp_state(state, self.model, self.mesh)
        self.dp.load_model_state_dict(state["model"])
        self.dp.load_optim_state_dict(self.optimizer, state["optim"])


def _local(data, sampler_indices, dims_dp: int, dp_rank: int, split: str, seq_len: int, sampler):
    local = sampler.local_slice(sampler_indices, dp_rank, dims_dp)
    return data.get(split, local, seq_len)


def run(cfg: Config, run_dir: Path, data_path: Path, device: torch.device | None = None) -> list[dict]:
    """Train according to ``cfg`` on this rank; returns the logged metric rows (rank 0; else [])."""
    from ndtrain.data import GlobalBatchSampler, TokenData

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    t = cfg.training
    device = device or device_for_rank(rank, t.device)
    dims = ParallelDims.from_config(cfg.parallel, world)
    mesh = dims.build_mesh(device.type)
    run_dir = Path(run_dir)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
    torch.manual_seed(t.seed)
    data = TokenData(data_path)
    T = cfg.data.seq_len
    sampler = GlobalBatchSampler(data.num_sequences("train", T), t.global_batch_size, t.seed)
    trainer = Trainer(cfg, mesh, device)
    dp_rank = mesh.group("dp").rank

    ckpt_root = run_dir / "checkpoints"
    start = cfg.checkpoint.load_from or (cfg.checkpoint.resume and ckpt.latest_checkpoint(ckpt_root))
    if start:
        state = trainer.tensor_state()
        meta = ckpt.load_checkpoint(Path(start), state)
        trainer.load_tensor_state(state)
        trainer.scheduler.load_state_dict(meta["scheduler"])
        sampler.load_state_dict(meta["sampler"])
        trainer.step_count = meta["step"]
        if trainer.scaler is not None and "loss_scale" in meta:
            trainer.scaler.load_state_dict(meta["loss_scale"])
        if rank == 0:
            print(f"resumed from {start} at step {trainer.step_count}", flush=True)

    log = metrics.MetricsLog(run_dir, enabled=rank == 0, keep_through_step=trainer.step_count)
    peak = metrics.peak_flops(device, t.dtype, cfg.logging.peak_flops_per_s)
    fpt = metrics.flops_per_token(cfg.model, T)
    if rank == 0:
        n_params = sum(p.numel() for p in trainer.model.parameters())
        where = "params" if world == 1 else "params on rank 0"
        print(f"ndtrain: {n_params / 1e6:.2f}M {where} | layout {dims} | {t.dtype} on {device.type} | "
              f"{fpt / 1e6:.1f} MFLOP/token | peak {peak / 1e9 if peak else float('nan'):.1f} "
              f"GFLOP/s per rank", flush=True)

    def val_loss() -> float:
        nval = data.num_sequences("val", T)
        batches = []
        for b in range(t.eval_batches):
            idx = [(b * t.global_batch_size + j) % nval for j in range(t.global_batch_size)]
            batches.append(_local(data, idx, dims.dp, dp_rank, "val", T, sampler))
        return trainer.eval_loss(batches)

    if trainer.step_count == 0:
        log.log({"step": 0, "val_loss": val_loss()})
    stop = min(t.steps, t.stop_at_step) if t.stop_at_step else t.steps
    window_t, window_tokens = 0.0, 0
    # rank 0 generates alone: not with split heads / vocab, nor with experts on other ranks (ep)
    can_sample = dims.tp == 1 and dims.cp == 1 and dims.pp == 1 and dims.ep == 1
    # ... nor with ZeRO-3 parameters sharded over ranks (a forward all-gathers them: collective)
    can_sample = can_sample and not (cfg.parallel.zero_stage == 3 and dims.dp_shard * dims.cp > 1)
    mesh.reset_stats()
    first_step = trainer.step_count + 1
    while trainer.step_count < stop:
        step = trainer.step_count + 1
        inputs, labels = _local(data, sampler.next_global(), dims.dp, dp_rank, "train", T, sampler)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        trainer.measure_memory = step == first_step  # the activation meter slows the step it runs in
        out = trainer.step(inputs, labels)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        window_t += dt
        window_tokens += t.global_batch_size * T
        row = None
        if step % cfg.logging.log_every == 0 or step == stop:
            comm_bytes = mesh.reset_stats()
            tps = window_tokens / window_t
            mem = comm.all_reduce_scalar(metrics.peak_memory_bytes(device), mesh.group("dp_cp"),
                                         op=dist.ReduceOp.MAX, device=device)
            row = {"step": step, "loss": out["loss"], "lr": out["lr"], "grad_norm": out["grad_norm"],
                   "tokens_per_s": tps, "step_time_s": window_t / (window_tokens / (t.global_batch_size * T)),
                   "mfu": fpt * tps / (peak * world) if peak else None, "peak_mem_bytes": int(mem),
                   "comm_bytes": comm_bytes}
            row.update({k: v for k, v in out.items()
                        if k.startswith(("moe_", "aux_", "mtp_", "mem_", "loss_scale", "skipped"))})
            window_t, window_tokens = 0.0, 0
        if (t.eval_every and step % t.eval_every == 0) or step == t.steps:
            row = row or {"step": step, "loss": out["loss"]}
            row["val_loss"] = val_loss()
        if row:
            log.log(row)
        if cfg.checkpoint.every and (step % cfg.checkpoint.every == 0 or step == stop):
            meta = {"step": step, "scheduler": trainer.scheduler.state_dict(),
                    "sampler": sampler.state_dict(), "layout": dims.degrees()}
            if trainer.scaler is not None:
                meta["loss_scale"] = trainer.scaler.state_dict()
            ckpt.save_checkpoint(ckpt_root, step, trainer.tensor_state(), meta, cfg.checkpoint.keep_last)
        if rank == 0 and can_sample and t.sample_every and step % t.sample_every == 0:
            print(f"sample @ {step}: {sample_text(trainer, data, cfg)!r}", flush=True)
    if rank == 0 and trainer.step_count == t.steps:
        if can_sample:
            print(f"sample: {sample_text(trainer, data, cfg)!r}", flush=True)
        else:
            print("sample: skipped (this layout splits the forward over ranks: tp / cp / pp / ep / "
                  "sharded ZeRO-3)", flush=True)
        if cfg.logging.plot and log.rows:
            print(f"plot: {metrics.plot_run(run_dir)}", flush=True)
    if dist.is_initialized():  # nobody tears the process group down while rank 0 still samples
        dist.barrier()
    return log.rows


@torch.no_grad()
def sample_text(trainer: Trainer, data, cfg: Config) -> str:
    """Generate ``sample_tokens`` after ``sample_prompt`` (KV cache; temperature / top-k)."""
    from ndtrain.generate import generate

    tok = data.tokenizer
    ids = tok.encode(cfg.training.sample_prompt) or [tok.eos_id]
    prompt = torch.tensor(ids[-(cfg.model.max_seq_len - 1):], dtype=torch.long)
    gen = torch.Generator().manual_seed(cfg.training.seed)
    trainer.model.eval()
    ctx = (torch.autocast(trainer.device.type, dtype=trainer.autocast_dtype) if trainer.autocast
           else contextlib.nullcontext())
    with ctx:
        n_new = max(0, min(cfg.training.sample_tokens, cfg.model.max_seq_len - prompt.numel()))
        out = generate(trainer.model, prompt.to(trainer.device), n_new,
                       temperature=cfg.training.sample_temperature, top_k=cfg.training.sample_top_k,
                       generator=gen)
    trainer.model.train()
    return tok.decode(out.tolist())
