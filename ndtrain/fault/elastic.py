"""Elastic continuation on fewer ranks (``ndtrain train --elastic --max-restarts K``).

The supervised restart (``ndtrain.fault.supervisor``) starts the same world again. With
``--elastic``, when a rank does not come back the job goes on with the survivors instead:

* **lost rank** (the local launcher's definition): after a failed attempt, a rank is lost for
  good when (a) a marker ``RUN_DIR/elastic/lost_rank{r}`` exists (written by whoever knows the
  device is gone: a health check, an operator, or the chaos driver's ``lose=True``), or (b) the
  launcher blamed that same rank for the last ``fail_limit`` failures in a row (default 2: a
  rank that fails again right after a restart is taken as a broken device, not a transient
  fault). Ranks are the attempt's ranks 0..W-1; after a change the survivors are renumbered.
* **new layout** (``choose_layout``): the planner's search (``ndtrain.planner.search.search``)
  ranks the layouts of the new world size that ``ndtrain train`` accepts and that fit; the first
  whose config also passes ``ndtrain.config.validate`` wins. The global batch stays (each rank
  takes G / dp sequences, cut into more or fewer microbatches), and so does everything outside
  the ``parallel`` section, the microbatch size and the activation-checkpointing policy, which
  come from the plan. A DiLoCo run keeps its ``dp_replicate`` (its checkpoint holds one AdamW
  state per replica).
* **resume**: the next attempt starts ``W - lost`` ranks with that config; they resume from the
  newest verified checkpoint, which DCP reshards to the new layout; the sampler is layout
  independent (the same global batches follow). So the losses after the change equal a fresh
  ``checkpoint.load_from`` resume of that checkpoint in the new layout.

Each change prints one line and logs an ``elastic`` event: ``from_world``, ``to_world``,
``lost_ranks``, ``reason``, ``from_layout`` / ``to_layout`` (``ParallelDims`` degrees),
``overrides`` (the config keys that changed, with their new values), ``local_batch`` and
``microbatches`` before / after, ``step`` (the checkpoint resumed from) and ``last_step``.
"""
from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from pathlib import Path

from ndtrain.config import Config, ConfigError, apply_overrides, validate
from ndtrain.events import log_event

MARKER_DIR = "elastic"


def mark_lost(run_dir: Path, rank: int) -> Path:
    """Declare rank ``rank`` of the running attempt lost for good (the marker the launcher reads)."""
    path = Path(run_dir) / MARKER_DIR / f"lost_rank{rank}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("lost\n")
    return path


def _degrees(cfg: Config, world: int) -> dict:
    from ndtrain.mesh import ParallelDims

    return ParallelDims.from_config(cfg.parallel, world).degrees()


def _accelerator_name(cfg: Config) -> str:
    """``cpu`` for CPU runs; on CUDA the planner's entry for this GPU when one matches, else H100."""
    import torch

    if cfg.training.device == "cpu" or not torch.cuda.is_available():
        return "cpu"
    from ndtrain.planner.hardware import get_accelerator

    name = torch.cuda.get_device_name(0)
    for cand in ("H200", "H100", "A100", "B200", "L40S"):
        if cand in name:
            try:
                get_accelerator(cand)
                return cand
            except ValueError:
                continue
    return "H100"


def choose_layout(cfg: Config, world: int) -> tuple[Config, dict]:
    """The config of ``cfg`` for ``world`` ranks: the planner's best layout that validates.

    Returns (new config, the dotted overrides that changed). Raises ConfigError when no layout of
    ``world`` ranks validates and fits (naming the world size and the batch)."""
    from ndtrain.planner.hardware import Cluster, get_accelerator
    from ndtrain.planner.layout import Workload, config_overrides
    from ndtrain.planner.model_spec import from_model_config
    from ndtrain.planner.search import search

    t, T = cfg.training, cfg.data.seq_len
    spec = from_model_config(cfg.model)
    cluster = Cluster(get_accelerator(_accelerator_name(cfg)), world, gpus_per_node=world)
    w = Workload(seq_len=T, global_batch_tokens=t.global_batch_size * T,
                 precision="mixed" if t.dtype in ("bfloat16", "float16") else "fp32")
    tried = 0
    for plan in search(spec, cluster, w, top=0):
        lay = plan.layout
        if t.local_sgd_steps and lay.dp_replicate != cfg.parallel.dp_replicate:
            continue
        over = {k: v for k, v in config_overrides(lay, w).items()
                if k.startswith("parallel.") or k in ("training.micro_batch_size", "training.activation_checkpoint")}
        over.setdefault("parallel.pp_microbatches", 0)  # the plan's microbatch size decides
        new = copy.deepcopy(cfg)
        apply_overrides(new, over)
        tried += 1
        try:
            validate(new, world)
        except ConfigError:
            continue
        changed = {k: v for k, v in over.items() if _get(cfg, k) != _get(new, k)}
        return new, changed
    raise ConfigError(f"elastic: no layout of {world} rank(s) validates and fits for global batch "
                      f"{t.global_batch_size} ({tried} planned layouts checked)")


def _get(cfg: Config, dotted: str):
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key, None)


class Elastic:
    """The world of a supervised job that may shrink (see the module docstring).

    ``start()`` runs one attempt with the current config and world (``launch(cfg, world)``);
    ``after_failure(error, step, last_step)`` decides, after a failed attempt, whether ranks
    were lost and, if so, switches to the new world and config (an ``elastic`` event)."""

    def __init__(self, cfg: Config, world: int, run_dir: Path, launch: Callable[[Config, int], object],
                 fail_limit: int = 2, say: Callable[[str], None] = print):
        if fail_limit < 1:
            raise ConfigError(f"elastic fail_limit ({fail_limit}) must be >= 1")
        self.cfg, self.world, self.run_dir, self.launch = cfg, world, Path(run_dir), launch
        self.fail_limit, self.say = fail_limit, say
        self.blamed: list[int | None] = []  # rank blamed for each failure since the last change

    def start(self):
        return self.launch(self.cfg, self.world)

    def lost_ranks(self, rank: int | None) -> tuple[list[int], str]:
        """The ranks lost after a failure blamed on ``rank`` (None: not known), and why."""
        self.blamed.append(rank)
        marked = sorted(int(p.name[9:]) for p in (self.run_dir / MARKER_DIR).glob("lost_rank*")
                        if p.name[9:].isdigit() and int(p.name[9:]) < self.world)
        if marked:
            return marked, "marked lost (" + ", ".join(f"{MARKER_DIR}/lost_rank{r}" for r in marked) + ")"
        recent = self.blamed[-self.fail_limit:]
        if rank is not None and len(recent) == self.fail_limit and all(b == rank for b in recent):
            return [rank], f"rank {rank} failed {self.fail_limit} times in a row"
        return [], ""

    def after_failure(self, rank: int | None, step: int, last_step: int | None) -> dict | None:
        """Shrink the world when ranks were lost; returns the ``elastic`` event (None: same world).
        Raises ConfigError when no rank survives or no layout of the survivors validates."""
        lost, reason = self.lost_ranks(rank)
        if not lost:
            return None
        to_world = self.world - len(lost)
        if to_world < 1:
            raise ConfigError(f"elastic: every rank is lost ({reason}); nothing to continue on")
        new, changed = choose_layout(self.cfg, to_world)
        t0, t1 = self.cfg.training, new.training
        before, after = _degrees(self.cfg, self.world), _degrees(new, to_world)
        local0, local1 = t0.global_batch_size // _dp(before), t1.global_batch_size // _dp(after)
        mb0 = -(-local0 // (t0.micro_batch_size or local0))
        mb1 = -(-local1 // (t1.micro_batch_size or local1))
        ev = log_event(self.run_dir, "elastic", from_world=self.world, to_world=to_world, lost_ranks=lost,
                       reason=reason, from_layout=before, to_layout=after, overrides=changed,
                       global_batch=t1.global_batch_size, local_batch=[local0, local1], microbatches=[mb0, mb1],
                       step=step, last_step=last_step)
        self.say(f"ndtrain: elastic: rank(s) {lost} lost ({reason}); continuing on {to_world} of {self.world} "
                 f"ranks from step {step}: layout {_short(before)} -> {_short(after)}; global batch "
                 f"{t1.global_batch_size} kept ({local0} -> {local1} sequences per rank, {mb0} -> {mb1} "
                 "microbatches); set " + ", ".join(f"{k}={v}" for k, v in changed.items()))
        for p in (self.run_dir / MARKER_DIR).glob("lost_rank*"):
            p.unlink()
        self.cfg, self.world, self.blamed = new, to_world, []
        return ev


def _dp(deg: dict) -> int:
    return deg.get("dp_replicate", 1) * deg.get("dp_shard", 1)


def _short(deg: dict) -> str:
    return " x ".join(f"{k}{v}" for k, v in deg.items() if v > 1) or "single"


def replan_for_world(cfg: Config, world: int, run_dir: Path, rank: int, say: Callable[[str], None] = print) -> Config:
    """Under torchrun (``--elastic``; torchrun's ``--nnodes=MIN:MAX`` restarts the workers at the
    new world size when a node does not come back): when the run directory's newest checkpoint
    was written by another number of ranks, the planner's layout for ``world`` (``choose_layout``);
    rank 0 logs the ``elastic`` event and says so. Else ``cfg`` unchanged."""
    from ndtrain.checkpoint.dcp import latest_checkpoint

    path = latest_checkpoint(Path(run_dir) / "checkpoints")
    meta = path / "meta.json" if path else None
    if meta is None or not meta.is_file():
        return cfg
    before = json.loads(meta.read_text()).get("layout") or {}
    old = math.prod(before.values()) if before else world
    if old == world:
        return cfg
    new, changed = choose_layout(cfg, world)
    if rank == 0:
        after = _degrees(new, world)
        reason = f"torchrun started {world} workers; the checkpoint was written by {old}"
        log_event(run_dir, "elastic", from_world=old, to_world=world, lost_ranks=None, reason=reason,
                  from_layout=before, to_layout=after, overrides=changed, global_batch=new.training.global_batch_size,
                  step=int(path.name[5:]), launcher="torchrun")
        say(f"ndtrain: elastic: {reason}; layout {_short(before)} -> {_short(after)}, global batch "
            f"{new.training.global_batch_size} kept")
    return new
