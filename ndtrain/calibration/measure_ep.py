"""What an expert-parallel rank runs and waits for, measured for the eager step-time model
(``planner.eager_axes_time``; ``bench/planner_calibration.py``).

* ``ep_moe_seconds``: one MoE layer's own work on a rank, from the code the trainer runs. Under
  ep > 1 the layer's ``GroupedExperts`` is replaced by ``ndtrain.parallel.ep.layers.
  ExpertParallelExperts`` on an ``AxisGroup`` of ``ep`` ranks without a process group: its count
  exchange and token all-to-alls then copy the rank's own rows (``all_to_all_v`` with ``pg=None``),
  so the rank runs the whole EP path (route, sort, count exchange, dispatch copy, regroup by local
  expert, the E / ep local experts' grouped matmul over ``k N`` rows, inverse regroup, combine copy,
  weighted sum) at the shapes of a rank whose experts receive the mean load. Its outputs are not
  the single process's (the rank's own rows meet the rank's experts): a stand-in for time only.
  ``moe_experts_s``: the E / ep local experts alone on those ``k N`` rows (forward + backward),
  the part of the layer that grows with the rows a rank receives.
* ``measure_ep_imbalance``: the routing of a run, replayed. An EP rank's experts receive the rows
  that the ep ranks of its group routed to them; with skewed routing one rank gets up to ``ep``
  times the mean, and every rank then waits for it at the combine all-to-all (forward and
  backward). The replay trains the same model and batches in one process (the EP run's routing
  is the single process's: ``tests/parallel`` pins EP to the single-process oracle), records each
  training forward's per-expert counts, and returns ``moe_imbalance``: the busiest ep rank's
  received rows / the group's mean, averaged over MoE layers, microbatches and timed steps (the
  planner's ``Layout.moe_imbalance`` on the GPU side).
"""
from __future__ import annotations

import statistics
import time


def median_seconds(fn, reps: int, warmup: int = 0) -> float:
    """Median wall seconds of ``reps`` calls of ``fn`` after ``warmup`` untimed ones (the planner's
    one timing loop; ``measure_eager`` uses it too)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ep_moe_seconds(model_cfg: dict, ep: int, b: int, T: int, dt, g, reps: int) -> dict:
    """Seconds per microbatch of (b, T) tokens, forward + backward in training mode, on one rank:
    ``moe_mlp_s`` the MoE layer (``ndtrain.model.moe.MoE``; with ``ep`` > 1 through
    ``ExpertParallelExperts`` on a group without a process group, module docstring) and, with ep >
    1, ``moe_experts_s`` its E / ep local experts alone on ``k b T`` rows split evenly (medians of
    ``reps``; inputs from generator ``g``, dtype ``dt``). Raises ValueError if E % ep != 0."""
    import torch

    from ndtrain.config.schema import ModelConfig
    from ndtrain.mesh import AxisGroup
    from ndtrain.model.moe import MoE
    from ndtrain.parallel.ep.layers import ExpertParallelExperts

    cfg = ModelConfig(**model_cfg)
    moe = MoE(cfg).to(dt).train()
    if ep > 1:
        moe.experts = ExpertParallelExperts(moe.experts, AxisGroup("ep", ep, 0, None), tally=moe.stats)
    xs = [torch.randn(b, T, cfg.dim, generator=g, dtype=dt).requires_grad_() for _ in range(2)]

    def layer():
        for x in xs:
            y = moe(x)
            y.backward(torch.ones_like(y))

    out = {"moe_mlp_s": median_seconds(layer, reps, warmup=1) / len(xs)}
    if ep > 1:
        el, rows = cfg.moe_experts // ep, cfg.moe_top_k * b * T
        experts = moe.experts  # the rank's E / ep experts, as ExpertParallelExperts holds them
        counts = torch.full((el,), rows // el, dtype=torch.int64)
        counts[: rows % el] += 1
        rs = [torch.randn(rows, cfg.dim, generator=g, dtype=dt).requires_grad_() for _ in range(2)]

        def local():
            for r in rs:
                y = super(ExpertParallelExperts, experts).forward(r, counts)  # GroupedExperts.forward
                y.backward(torch.ones_like(y))

        out["moe_experts_s"] = median_seconds(local, reps, warmup=1) / len(rs)
    return out


def rank_imbalance(counts, ep: int, dp: int) -> list[float]:
    """Busiest-rank factors of recorded routing. ``counts``: (steps, G / mb microbatches in the
    single process's order, MoE layers, E) kept assignments per expert; data-parallel rank r holds
    the ``m = G / (mb dp)`` consecutive microbatches ``[r m, (r + 1) m)`` (``data.sampler.
    local_slice``) and the ep group of rank r is ranks ``[ep (r // ep), ep (r // ep + 1))``; its
    rank q holds experts ``[q E / ep, (q + 1) E / ep)``. Returns per step the mean over layers,
    local microbatches j and ep groups of ``max_q R_q / mean_q R_q``, R_q the rows rank q's experts
    receive for microbatch j (1.0 where a group routes nothing). Raises ValueError for shapes that
    do not split."""
    import torch

    s, n_mb, L, E = counts.shape
    if dp % ep or n_mb % dp or E % ep:
        raise ValueError(f"{n_mb} microbatches / dp={dp} / ep={ep} / {E} experts do not split")
    m = n_mb // dp
    c = counts.double().view(s, dp // ep, ep, m, L, E)  # (step, group, source rank, j, layer, E)
    recv = c.sum(2).view(s, dp // ep, m, L, ep, E // ep).sum(-1)  # (step, group, j, layer, dest rank)
    mean = recv.mean(-1)
    f = torch.where(mean > 0, recv.max(-1).values / mean.clamp(min=1e-30), torch.ones_like(mean))
    return f.flatten(1).mean(1).tolist()


def _replay_worker(rank, world, cfg_dict, data_path, run_dir):
    import contextlib
    import io

    import torch

    from ndtrain.config import config_from_dict
    from ndtrain.model.moe import GroupedExperts
    from ndtrain.train import loop as train

    cfg = config_from_dict(cfg_dict)
    rec = []

    def hook(module, args):
        # training forwards only; a checkpoint's recompute (inside backward) would count twice
        if (isinstance(module, GroupedExperts) and module.training and torch.is_grad_enabled()
                and torch._C._current_graph_task_id() == -1):
            rec.append(args[1].detach().clone())  # (E,) kept assignments per expert, this forward

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the replay's console is not the caller's
            train.run(cfg, run_dir, data_path)
    finally:
        handle.remove()
    return torch.stack(rec) if rec else torch.zeros(0)


def measure_ep_imbalance(cfg, world: int, skip_first: int = 2, timeout_s: float = 600.0) -> dict:
    """The routing imbalance of ``cfg``'s expert-parallel run on ``world`` ranks, replayed (module
    docstring): one fresh
    process (one thread) trains ``cfg.training.steps`` steps of the same model, seed and batches
    with every parallel degree 1, checkpoints and sampling off. Returns ``moe_imbalance`` (mean of
    ``rank_imbalance`` over the steps after ``skip_first``, the steps a calibration times) and
    ``per_step``. Raises ValueError for tp / cp / pp / dp_replicate > 1 or ep == 1."""
    import tempfile

    from ndtrain.config import config_from_dict
    from ndtrain.config.schema import ParallelConfig
    from ndtrain.data import prepare_data
    from ndtrain.spawn import spawn

    p, t = cfg.parallel, cfg.training
    if p.ep == 1 or p.tp * p.cp * p.pp * p.dp_replicate > 1:
        raise ValueError("measure_ep_imbalance covers ep > 1 over data parallel ranks only")
    dp = p.dp_shard if p.dp_shard > 0 else world
    one = config_from_dict(cfg.to_dict())
    one.parallel = ParallelConfig()  # routing does not depend on the layout (EP equals the single process)
    one.checkpoint.every, one.training.sample_every, one.training.eval_every = 0, 0, 0
    one.logging.plot = False
    path = prepare_data(one.data, one.model.vocab_size)
    with tempfile.TemporaryDirectory() as d:
        (rec,) = spawn(_replay_worker, 1, (one.to_dict(), str(path), d), threads=1, timeout_s=timeout_s)
    layers = sum(1 for i in range(one.model.n_layers) if one.model.is_moe_layer(i))
    n_mb = t.global_batch_size // t.micro_batch_size
    per_step = rank_imbalance(rec.view(-1, n_mb, layers, rec.shape[-1]), p.ep, dp)
    timed = per_step[skip_first:] or per_step
    return {"moe_imbalance": sum(timed) / len(timed), "per_step": per_step}
