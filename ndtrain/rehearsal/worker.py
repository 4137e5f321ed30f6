"""One rank of a layout rehearsed in this process: the real ``Trainer`` built and stepped in the
fake world (``ndtrain.rehearsal.fake``), measured (``ndtrain.rehearsal.measure``).

    python -m ndtrain.rehearsal.worker JOB.json OUT.json

JOB: ``preset``, ``overrides`` (dotted keys), ``world``, ``rank``, ``warmup``, ``replay``
(optional, default true: ``rehearse_rank``). OUT: the
``measure_step`` figures plus ``wall_s`` (build + steps) and ``host_peak_bytes`` (this process's
peak resident memory). Each rank runs in its own process: the fake process group and the
flight recorder are process-global, and the host peak is then the rank's own."""
from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import torch


def batch_reads(cfg, trainer) -> list[tuple]:
    """The host reads of the batch agreement on a real step (``Trainer._agree_on_batch``): this
    rank's valid labels, then what its all-reduce holds: valid labels of the global batch (every label is valid: the rehearsal's batch is all token 0),
    the sum of local batch sizes and of their squares over the loss group."""
    group, d = trainer.mesh.group(trainer.loss_group), trainer.mesh.dims
    b, t = cfg.training.global_batch_size // d.dp, cfg.data.seq_len
    local = b * t // d.cp  # this rank's valid labels (its cp share of each sequence)
    f64 = torch.float64
    return [(torch.int64, local), (f64, cfg.training.global_batch_size * t), (f64, b * group.size),
            (f64, b * b * group.size)]


def pipeline_header(cfg, trainer):
    """(shape, dtype) of the pipeline message with header tag ``tag`` (``pp.p2p.tag``): every stage
    boundary carries the residual stream, (rows of its microbatch, T / cp [/ tp under sequence
    parallel], dim), in the dtype of the stage's parameters, what the real peers send: ZeRO's
    compute dtype (ZeRO-1/2/3 hold bf16 / fp16 parameters under autocast), else the master dtype
    (bf16 autocast over fp32 weights sends float32)."""
    from ndtrain.parallel.parallelize import param_dtype
    from ndtrain.parallel.pp.stage import plan_stage

    d, p = trainer.mesh.dims, cfg.parallel
    info = plan_stage(cfg, 0)
    n_stages = info.p * info.v
    b = cfg.training.global_batch_size // d.dp
    t = cfg.data.seq_len // d.cp // (d.tp if p.sequence_parallel else 1)

    def header(tag: int):
        mb, m = (tag // 4) // n_stages, trainer.pipeline.m
        rows = b // m + (1 if mb < b % m else 0)  # tensor_split's chunks
        return (rows, t, cfg.model.dim), dtype
    dtype = getattr(trainer.dp, "compute_dtype", None) or param_dtype(cfg)
    return header


def rehearse_rank(cfg, world: int, rank: int, warmup: int = 1, routing: str | None = None,
                  replay: bool = True) -> dict:
    """Build ``Trainer(cfg)`` as global ``rank`` of ``world`` in the fake world and measure a step
    after ``warmup`` steps. ``replay``: the fake world's fast paths (``rehearsal.replay.fast_paths``:
    ZeRO's per-piece gradient pack replayed after its first call per shape, ``prim.device`` past
    the counters' tree walks; False: all dispatched as they come, the slow twins). Raises
    RuntimeError if a step's host reads did not consume the queued batch-agreement values (the
    trainer's path changed under the rehearsal)."""
    from ndtrain.mesh import ParallelDims
    from ndtrain.rehearsal.fake import fake_pipeline_messages, fake_process_group, fake_tensors
    from ndtrain.rehearsal.measure import measure_step
    from ndtrain.rehearsal.replay import fast_paths
    from ndtrain.train.trainer import Trainer

    t0 = time.perf_counter()
    with fake_process_group(rank, world), fast_paths(replay) as packs:
        mesh = ParallelDims.from_config(cfg.parallel, world).build_mesh("cpu")
        with fake_tensors() as reads:
            if cfg.model.is_moe:  # routed counts computed from the forced routing (rehearsal.routing)
                from ndtrain.rehearsal.routing import Shadows

                reads.shadows = Shadows()
            skew = _skewed(routing, cfg.parallel.ep)
            trainer = Trainer(cfg, mesh, torch.device("cpu"))
            b = cfg.training.global_batch_size // mesh.dims.dp
            x = torch.zeros(b, cfg.data.seq_len, dtype=torch.long)

            def before_step():
                _check_consumed(reads)
                reads.expect(batch_reads(cfg, trainer))
            with fake_pipeline_messages(pipeline_header(cfg, trainer)), skew:
                out = measure_step(trainer, x, x, warmup, before_step)
            _check_consumed(reads)
            out["host_reads"] = reads.reads
            out["microbatches"] = microbatches(cfg, trainer)
    if packs is not None:
        out["pack_replay"] = {"hits": packs.hits, "misses": packs.misses, "skipped": packs.skipped,
                              "refused": packs.refused}
    out["wall_s"] = time.perf_counter() - t0
    out["host_peak_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def microbatches(cfg, trainer) -> int:
    """Microbatches of one step on this rank: the pipeline's, else local batch / micro batch."""
    if trainer.pipeline is not None:
        return trainer.pipeline.m
    local = cfg.training.global_batch_size // trainer.mesh.dims.dp
    return max(1, local // (cfg.training.micro_batch_size or local))


def _skewed(routing: str | None, ep: int):
    """``skewed:S``: the model's forced routing replaced by ``routing.skewed_assignment`` (a
    context); else a null context."""
    import contextlib
    from unittest import mock

    from ndtrain.rehearsal.routing import parse_routing, skewed_assignment

    if not routing or not routing.startswith("skewed:"):
        return contextlib.nullcontext()
    _, s = parse_routing(routing, ep)
    return mock.patch("ndtrain.model.moe.balanced_assignment", skewed_assignment(s, ep))


def _check_consumed(reads) -> None:
    if reads.queue:
        raise RuntimeError(f"{len(reads.queue)} queued host reads were not consumed by the step")


def main(argv: list[str]) -> int:
    from ndtrain.config import load_config

    job = json.loads(Path(argv[0]).read_text())
    cfg = load_config(job["preset"], job.get("overrides") or {}, world_size=job["world"])
    out = rehearse_rank(cfg, job["world"], job["rank"], job.get("warmup", 1), job.get("moe_routing"),
                        job.get("replay", True))
    Path(argv[1]).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def measure_real_rank(rank: int, world: int, preset: str, overrides: dict, warmup: int = 1) -> dict:
    """The same measured step on a real rank of a running process group (gloo): the rehearsal's
    reference. Same batch (all token 0), same instruments."""
    from ndtrain.config import load_config
    from ndtrain.mesh import ParallelDims
    from ndtrain.rehearsal.measure import measure_step
    from ndtrain.train.trainer import Trainer

    cfg = load_config(preset, overrides, world_size=world)
    mesh = ParallelDims.from_config(cfg.parallel, world).build_mesh("cpu")
    trainer = Trainer(cfg, mesh, torch.device("cpu"))
    b = cfg.training.global_batch_size // mesh.dims.dp
    x = torch.zeros(b, cfg.data.seq_len, dtype=torch.long)
    out = measure_step(trainer, x, x, warmup)
    out["microbatches"] = microbatches(cfg, trainer)
    return out
