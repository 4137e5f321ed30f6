"""The training run: build -> parallelize -> (resume) -> step -> log -> evaluate -> checkpoint -> sample.

``run(cfg, run_dir, data_path, device)`` drives one rank; the per-step work is ``Trainer.step``
(``ndtrain.train.trainer``; re-exported here with ``IGNORE_INDEX``). Each phase is its own function:
``_start`` (resume / load / fine-tune start), ``_log_row``, ``_val_loss``, ``_save``, ``_sample``.

Where a run starts (``_start``): the run directory's own newest complete checkpoint that verifies
against its manifest (with ``checkpoint.resume``; ``ndtrain.checkpoint.dcp.usable_checkpoint``) always
wins; otherwise ``checkpoint.load_from`` (another run's checkpoint, any layout: weights, optimizer,
schedule, data position and step); otherwise
``checkpoint.init_weights_from`` (weights only, from an ndtrain checkpoint of any layout or a
Hugging Face folder; fresh optimizer and schedule, step 0); otherwise the seeded initialisation.
Rank 0 prints which.

What leaves the run directory on the way (rank 0, with ``logging.plot``): ``loss.png`` is rewritten
after every checkpoint and evaluation, at the end of every job (also one stopped by
``training.stop_at_step``) and after an interruption. A write that fails (a full disk) ends the run
with one ``StorageError`` line naming the path and the last good checkpoint, which the failed save
never touches (``ndtrain.train.outputs``).
"""
from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ndtrain.checkpoint import dcp as ckpt
from ndtrain.config import Config, save_config
from ndtrain.data import GlobalBatchSampler, TokenData
from ndtrain.data.mixture import open_training_data
from ndtrain.fault import bad_steps, goodput, straggler
from ndtrain.mesh import Mesh, ParallelDims, device_for_rank
from ndtrain.model.lora import is_adapter
from ndtrain.parallel import comm, flight_recorder
from ndtrain.train import console, metrics, outputs, validation
from ndtrain.train.profiling import StepProfiler
from ndtrain.train.rundir import sample_model, sample_text, write_run_files
from ndtrain.train.trainer import IGNORE_INDEX, Trainer

__all__ = ["IGNORE_INDEX", "Trainer", "run", "sample_text"]


@dataclass
class _Run:
    """What the phases of one rank's run share."""

    cfg: Config
    rank: int
    world: int
    device: torch.device
    dims: ParallelDims
    mesh: Mesh
    trainer: Trainer
    data: TokenData
    sampler: GlobalBatchSampler
    run_dir: Path
    saver: ckpt.CheckpointSaver | None = None  # created by the first _save
    eval_sets: dict | None = None  # eval.sets: name -> TokenData (None: the held-out split)

    @property
    def ckpt_root(self) -> Path:
        return self.run_dir / "checkpoints"

    def local(self, indices, split: str):
        """This rank's (inputs, labels, documents) of the global batch ``indices`` of ``split``."""
        dp = self.mesh.group("dp")
        return self.data.get(split, self.sampler.local_slice(indices, dp.rank, dp.size), self.cfg.data.seq_len)

    def say(self, text: str) -> None:
        if self.rank == 0:
            print(text, flush=True)

    def last_good_checkpoint(self) -> tuple[Path | None, Path]:
        """``bad_steps.Restorable``: a save in flight becomes the newest good checkpoint first."""
        if self.saver is not None:
            self.saver.wait()
        return ckpt.usable_checkpoint(self.ckpt_root, self.run_dir), self.ckpt_root

    def restore(self, path: Path) -> tuple[int, tuple[int, int]]:
        """``bad_steps.Restorable``: resume from ``path``, the sampler kept where it is."""
        consumed = self.sampler.consumed
        _resume(self, path)
        skipped, self.sampler.consumed = (self.sampler.consumed, consumed), consumed
        return self.trainer.step_count, skipped


def run(cfg: Config, run_dir: Path, data_path: Path, device: torch.device | None = None) -> list[dict]:
    """Train according to ``cfg`` on this rank; returns the logged metric rows (rank 0; else []).
    Rank 0's console (progress, ``console.log``, TensorBoard) is ``ndtrain.train.console.RunConsole``.

    Raises ValueError (every rank) when ``checkpoint.load_from`` / ``init_weights_from`` is not a
    checkpoint, or a checkpoint's step leaves nothing to train (past ``training.steps``);
    StorageError (``ndtrain.errors``) when a write fails after start-up."""
    p = cfg.parallel  # every collective from here on runs under the deadline, recorded
    flight_recorder.configure(p.collective_timeout_s, p.flight_recorder_entries, Path(run_dir))
    try:  # start-up writes config.yaml and the tokenizer files: a full disk is one line here too
        r = _setup(cfg, Path(run_dir), Path(data_path), device)
    except BaseException as e:
        outputs.raise_storage_error(e, Path(run_dir) / "checkpoints", rank=-1)
        raise
    lg = cfg.logging
    con = console.RunConsole(r.run_dir, lg.progress, lg.tensorboard, enabled=r.rank == 0)
    try:
        con.open()
        return _train(r, con)
    except BaseException as e:
        _after_failure(r, e)
        raise
    finally:
        con.close()


def _after_failure(r: _Run, e: BaseException) -> None:
    """On the way out of a failed or interrupted run: the flight recorder's dump, the plot after an
    interruption; a failed write becomes its one-line StorageError (raised from here)."""
    with contextlib.suppress(OSError):  # a full disk must not hide the error behind this one
        flight_recorder.recorder().dump(r.rank)  # this rank's last collectives, for the post-mortem
    if isinstance(e, KeyboardInterrupt):
        _plot(r, safe=True)
    outputs.raise_storage_error(e, r.ckpt_root, r.rank)


def _train(r: _Run, con: console.RunConsole) -> list[dict]:
    """``run``'s phases after set-up; ``con`` echoes rows and draws the progress (rank 0)."""
    cfg = r.cfg
    t, trainer = cfg.training, r.trainer
    gp = goodput.Goodput(r.run_dir, r.rank)  # where the job's wall time goes (ndtrain.fault.goodput)
    with gp.phase("checkpoint_load"):
        _start(r)
    log = metrics.MetricsLog(r.run_dir, enabled=r.rank == 0, keep_through_step=trainer.step_count, echo=con.row)
    fpt = metrics.flops_per_token(cfg.model, cfg.data.seq_len)
    peak = metrics.peak_flops(r.device, t.dtype, cfg.logging.peak_flops_per_s, fp8=t.fp8)
    basis = metrics.peak_basis(r.device, t.dtype, cfg.logging.peak_flops_per_s, fp8=t.fp8)  # rows' mfu_peak
    _print_header(r, fpt, peak, basis)
    if trainer.step_count == 0:
        with gp.phase("eval"):
            log.log({"step": 0, **_val_loss(r)})
    stop = min(t.steps, t.stop_at_step) if t.stop_at_step else t.steps
    window = [0.0, 0]  # seconds, steps since the last logged row
    r.mesh.reset_stats()
    first_step = trainer.step_count + 1
    con.begin(first_step, stop)
    guard = bad_steps.BadStepGuard(t.max_bad_steps, t.spike_zscore, t.spike_window)
    strag = straggler.StragglerMonitor(trainer.world, r.device)
    prof = StepProfiler(cfg.logging.profile_steps, r.run_dir, r.rank, r.device.type, trainer)  # + phases
    gp.begin_steps()
    while trainer.step_count < stop:
        step = trainer.step_count + 1
        prof.begin(step)
        t_data = time.perf_counter()
        inputs, labels, documents = r.local(r.sampler.next_global(), "train")
        t_data = time.perf_counter() - t_data
        trainer.measure_memory = step == first_step  # the activation meter slows the step it runs in
        out, dt = _timed_step(r, inputs, labels, documents)
        prof.end(step)
        con.step(step, out)
        strag.record(dt, t_data)
        gp.step(step, dt + t_data)
        if bad_steps.after_step(guard, step, out, r.run_dir, r.rank,
                                lambda why, s=step: gp.redo(s, bad_steps.rollback, r, why, s)):
            log = metrics.MetricsLog(r.run_dir, enabled=r.rank == 0, keep_through_step=trainer.step_count,
                                     echo=con.row)
            window = [0.0, 0]  # the rows past the checkpoint are redone (metrics.prev.jsonl keeps them)
            continue
        window[0] += dt
        window[1] += 1
        row = None
        if step % cfg.logging.log_every == 0 or step == stop:
            row = _log_row(r, step, out, window, fpt, peak)
            peak, basis = metrics.recheck_cpu_peak(row, peak, basis, r.device, t.dtype)  # sets mfu_peak
            row.update(strag.report(r.run_dir, step))  # collective: per-rank time percentiles
            window = [0.0, 0]
        if (t.eval_every and step % t.eval_every == 0) or step == t.steps:
            row = row or {"step": step, "loss": out["loss"]}
            with gp.phase("eval"):
                row.update(_val_loss(r))
        if row:
            log.log(row)
        saved = cfg.checkpoint.every and (step % cfg.checkpoint.every == 0 or step == stop)
        if saved:
            with gp.phase("checkpoint_save"):
                _save(r, step)
            gp.report()
        if (saved or (row and "val_loss" in row)) and step != stop:
            _plot(r)  # the job's last step is drawn once, below
        if t.sample_every and step % t.sample_every == 0:
            _sample(r, f"sample @ {step}", quiet=True)
    prof.close()  # a window past this job's last step ends here
    if trainer.step_count == t.steps:
        _sample(r, "sample", quiet=False)
    _plot(r, quiet=False)  # every job's end, a stop_at_step too
    if r.saver is not None:
        with gp.phase("checkpoint_save"):
            r.saver.wait()  # an asynchronous save still writing is finalised before the group goes
    if dist.is_initialized():  # nobody tears the process group down while rank 0 still samples
        dist.barrier()
    gp.finish(r.say)  # the job's goodput line (rank 0; every attempt of a supervised job)
    return log.rows


def _setup(cfg: Config, run_dir: Path, data_path: Path, device: torch.device | None) -> _Run:
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    t = cfg.training
    device = device or device_for_rank(rank, t.device)
    dims = ParallelDims.from_config(cfg.parallel, world)
    mesh = dims.build_mesh(device.type)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
    torch.manual_seed(t.seed)
    data, sampler = open_training_data(cfg, data_path)  # token shards, chat rows, or a mixture of sources
    if cfg.data.format == "chat" and rank == 0:  # whole conversations per row (ndtrain.data.chat)
        print(data.console_line(cfg.data.seq_len), flush=True)
    if rank == 0:  # the run directory alone is enough to use the run (ndtrain.train.rundir)
        write_run_files(run_dir, data, cfg)
    trainer = Trainer(cfg, mesh, device)
    return _Run(cfg, rank, world, device, dims, mesh, trainer, data, sampler, run_dir,
                eval_sets=validation.open_sets(cfg, data))


def _read_meta(path: Path, key: str) -> dict:
    meta = Path(path) / "meta.json"
    if not meta.is_file():
        raise ValueError(f"{key}={path}: not an ndtrain checkpoint folder (no meta.json); give a "
                         "checkpoints/step_XXXXXXXX folder")
    return json.loads(meta.read_text())


def _start(r: _Run) -> None:
    """Resume, load or fine-tune start (see the module docstring); rank 0 says which."""
    c, steps = r.cfg.checkpoint, r.cfg.training.steps
    own = ckpt.usable_checkpoint(r.ckpt_root, r.run_dir) if c.resume else None  # verified, else the previous
    if own or c.load_from:
        path = own or Path(c.load_from)
        key = "the run's newest usable checkpoint" if own else "checkpoint.load_from"
        step = _read_meta(path, key)["step"]
        if not own:
            ckpt.require_verified(path, key)  # the run's own was verified by usable_checkpoint
        if step > steps or (not own and step == steps):
            raise ValueError(f"{key} {path} is at step {step}, past training.steps ({steps}): nothing "
                             "to train (raise training.steps, or use checkpoint.init_weights_from to start "
                             "a new run from its weights)")
        _resume(r, path)
        r.say(f"resumed from {path} ({key}) at step {r.trainer.step_count}")
    elif c.init_weights_from:
        _init_weights(r, Path(c.init_weights_from))
        r.say(f"initial weights from {c.init_weights_from} (checkpoint.init_weights_from); "
              "fresh optimizer and schedule, step 0")


def _resume(r: _Run, path: Path) -> None:
    tr = r.trainer
    state = tr.tensor_state()
    meta = ckpt.load_checkpoint(path, state)
    tr.load_tensor_state(state)
    tr.scheduler.load_state_dict(meta["scheduler"])
    r.sampler.load_state_dict(meta["sampler"])
    tr.step_count = meta["step"]
    if tr.scaler is not None and "loss_scale" in meta:
        tr.scaler.load_state_dict(meta["loss_scale"])


def _init_weights(r: _Run, path: Path) -> None:
    """Weights only: an ndtrain checkpoint (DCP reshards any layout) or a Hugging Face folder
    (``config.json`` + safetensors, converted by ``ndtrain.hf.folder``)."""
    state = r.trainer.tensor_state()["model"]
    # LoRA adapters are new: the source holds the base only, the adapters keep their initial values
    template = {k: v for k, v in state.items() if not is_adapter(k)}
    if (path / "config.json").is_file() and not (path / "meta.json").is_file():
        from ndtrain.hf.folder import load_hf_checkpoint

        _, hf_model = load_hf_checkpoint(path, "cpu", r.trainer.param_dtype)
        full = hf_model.state_dict()
        missing = sorted(set(template) - set(full))
        if missing:
            raise ValueError(f"checkpoint.init_weights_from={path}: the HF model lacks {missing[:5]}")
        for name, value in template.items():  # whole tensors into the template's global shapes
            src = full[name].to(value.dtype)
            if tuple(src.shape) != tuple(value.shape):
                raise ValueError(f"checkpoint.init_weights_from={path}: {name} has shape "
                                 f"{tuple(src.shape)}, this model {tuple(value.shape)}")
            template[name] = _fill(value, src)
    else:
        _read_meta(path, "checkpoint.init_weights_from")
        ckpt.load_tensors(path, {"model": template}, key="checkpoint.init_weights_from")  # verifies
    r.trainer.load_model_state({**state, **template})


def _fill(value, src: torch.Tensor):
    """``src`` (whole) in the form of ``value``: a DTensor gets its local shard of it."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(value, DTensor):
        return distribute_tensor(src.to(value.device), value.device_mesh, value.placements)
    return src.to(value.device)


def _print_header(r: _Run, fpt: float, peak: float | None, basis: str = "") -> None:
    if r.rank == 0:  # the whole model's parameters, whatever this rank holds of them
        r.say("\n".join(console.startup_summary(r.cfg, r.dims, r.data, r.run_dir, console.param_count(r.cfg.model),
                                                fpt, peak, r.device.type, basis)))


def _timed_step(r: _Run, inputs, labels, documents=None) -> tuple[dict, float]:
    sync = torch.cuda.synchronize if r.device.type == "cuda" else (lambda _d: None)
    sync(r.device)
    t0 = time.perf_counter()
    out = r.trainer.step(inputs, labels, documents)
    sync(r.device)
    return out, time.perf_counter() - t0


def _log_row(r: _Run, step: int, out: dict, window: list, fpt: float, peak: float | None) -> dict:
    """The metrics row of ``step``: losses, throughput over the steps since the last row, MFU,
    peak memory (max over dp x cp ranks; a collective), bytes per mesh axis, extra terms."""
    t = r.cfg.training
    seconds, n_steps = window
    tokens = n_steps * t.global_batch_size * r.cfg.data.seq_len
    tps = tokens / seconds
    comm_bytes = r.mesh.reset_stats()  # before the peak-memory all-reduce below (next window's)
    mem = comm.all_reduce_scalar(metrics.peak_memory_bytes(r.device), r.mesh.group("dp_cp"),
                                 op=dist.ReduceOp.MAX, device=r.device)
    row = {"step": step, "loss": out["loss"], "lr": out["lr"], "grad_norm": out["grad_norm"],
           "tokens_per_s": tps, "step_time_s": seconds / n_steps,
           "mfu": fpt * tps / (peak * r.world) if peak else None, "peak_mem_bytes": int(mem),
           "comm_bytes": comm_bytes}
    row["hfu"] = row["mfu"] and row["mfu"] * metrics.hfu_factor(r.cfg.model, r.cfg.data.seq_len,
                                                                t.activation_checkpoint)  # + recompute
    if r.cfg.data.format == "chat":  # this step's labels with a loss, over its label positions
        row["supervised_share"] = out["n_tokens"] / (t.global_batch_size * r.cfg.data.seq_len)
    ns = getattr(r.trainer.optimizer, "ns_flops_per_step", None)  # Muon's Newton-Schulz (this rank's)
    if row["hfu"] and ns is not None:
        row["hfu"] += ns() * n_steps / seconds / peak
    row.update({k: v for k, v in out.items()
                if k.startswith(("moe_", "aux_", "mtp_", "mem_", "loss_scale", "skipped"))})
    row.update(r.data.log_fields(r.sampler.consumed) if hasattr(r.data, "log_fields") else {})  # mixture shares
    return row


def _val_loss(r: _Run) -> dict[str, float]:
    """``val_loss`` (the held-out split) and ``val_loss/NAME`` per ``eval.sets`` entry
    (``ndtrain.train.validation``). Collective."""
    return validation.val_losses(r.trainer, r.sampler, r.data, r.eval_sets or {}, r.cfg)


def _save(r: _Run, step: int) -> None:
    tr = r.trainer
    meta = {"step": step, "scheduler": tr.scheduler.state_dict(), "sampler": r.sampler.state_dict(),
            "layout": r.dims.degrees()}
    if tr.scaler is not None:
        meta["loss_scale"] = tr.scaler.state_dict()
    c = r.cfg.checkpoint
    r.saver = r.saver or ckpt.CheckpointSaver(r.ckpt_root, c.keep_last, c.async_save, r.run_dir)
    try:
        r.saver.save(step, tr.tensor_state(), meta)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        outputs.raise_storage_error(e, r.ckpt_root, r.rank, r.ckpt_root / f"step_{step:08d}.tmp")
        raise


def _plot(r: _Run, quiet: bool = True, safe: bool = False) -> None:
    """Rank 0 rewrites ``loss.png`` (``ndtrain.train.outputs.refresh_plot``)."""
    outputs.refresh_plot(r.run_dir, r.rank == 0 and r.cfg.logging.plot, quiet, safe)


def _sample(r: _Run, label: str, quiet: bool) -> None:
    """Rank 0 generates: alone when the layout allows it (``ParallelPlan.sample_skip_reason``),
    else on a single-process copy of the weights gathered to it (collective: ``rundir.sample_model``).
    ``training.sample_tokens = 0``: no sample (every rank skips alike: the config is the same)."""
    if r.cfg.training.sample_tokens <= 0:
        return
    model, why = sample_model(r.trainer, r.cfg)
    if r.rank == 0 and not (why and quiet):
        print(f"{label}: skipped ({why})" if why else  # text, not repr
              f"{label}:\n{sample_text(r.trainer, r.data, r.cfg, model)}", flush=True)
