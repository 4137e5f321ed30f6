"""Step time of a layout: compute per operation, communication after overlap, pipeline bubble,
optimizer.

Compute (per microbatch on each pipeline stage, per rank) is ``compute.stage_op_times``: every GEMM
of the stage's own blocks (dense, MoE, MTP, head) timed by its shape (tile / wave quantisation,
HBM roofline), FlashAttention on the executed causal half of the T x T pairs (backward 2.5x the
forward), norms / RoPE / SwiGLU / residuals / cross entropy at HBM bandwidth, with the constants
of the accelerator's generation (``compute.GENERATIONS``). ``Accelerator.compute_efficiency`` > 0
(``--efficiency``) is v1's flat model: every GEMM at that share of peak. Recompute adds the
forward of the checkpointed blocks (selective: the attention core). Under ``dtype=float8`` only
the blocks' linear layers run at the FP8 peak; attention and the output head run at the bf16 peak
(``Cluster.precision_note``).

Overlap assumptions (stated, the same for every case):
  * TP / SP collectives: forward ones are exposed (they sit between dependent GEMMs); backward ones
    overlap with the weight-gradient GEMMs (half the backward), as in Megatron-LM's asynchronous TP
    communication (Narayanan 2021, Korthikanti 2022); the excess is exposed. Inside a TPU torus
    slice both directions hide behind the layer's GEMMs (XLA's collective matmul, ``torus.py``).
  * CP ring (Liu 2023): each K/V block exchange overlaps with the previous block's attention; the
    excess over attention compute is exposed. All-gather CP (Llama 3) and Ulysses are exposed; so
    are the linear mixers' state all-gathers and halo exchanges (``mixer_comm``: bytes per mixer).
  * EP all-to-all and PP send / recv are exposed (on the critical path of each microbatch).
  * ZeRO-3 gathers are prefetched under the forward / backward of the microbatch; ZeRO-2's
    reduce-scatters overlap with the backward that produces them; the excess is exposed.
  * The data-parallel gradient reduction after the last microbatch overlaps with that microbatch's
    backward (bucketed DDP, Li et al. 2020); ZeRO-1/2's weight all-gather with the next forward.
  * Optimizer step: memory-bound, reads and writes the local state once at HBM bandwidth.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ndtrain.planner.ac_memory import recompute_attention_share
from ndtrain.planner.comm import Links, estimate_axis_comm
from ndtrain.planner.compute import optimizer_seconds, stage_op_times
from ndtrain.planner.hardware import Cluster
from ndtrain.planner.layout import Layout, Workload, microbatches
from ndtrain.planner.memory import PRECISIONS, rank_params, recompute_fraction
from ndtrain.planner.mixer_comm import cp_stage_seconds
from ndtrain.planner.mixer_time import stage_mixers
from ndtrain.planner.pipeline import estimate_pipeline_time, rank_layers
from ndtrain.planner.torus import in_slice_tp, torus_tp_exposed


@dataclass
class StepEstimate:
    """Seconds per optimizer step and its parts (``parts`` sums to ``step_time_s``)."""

    step_time_s: float
    parts: dict = field(default_factory=dict)
    t_fwd: float = 0.0  # one microbatch forward on the slowest stage, incl. exposed comm
    t_bwd: float = 0.0
    microbatches: int = 1
    links: dict = field(default_factory=dict)
    raw_comm: dict = field(default_factory=dict)  # collective seconds before overlap (comm.py)
    stage_layers: int = 0  # blocks on the slowest stage
    compute_s: dict = field(default_factory=dict)  # compute by kind: gemm / attention / memory_bound


def stage_layout(spec, lay: Layout, w: Workload) -> list[int]:
    """Blocks per pipeline rank: the trainer's own split (``pipeline.rank_layers``), the one the
    memory model checks too. Exact for v = 1; for v > 1 a rank's blocks are the sum over its
    virtual chunks, and its time is modelled as that sum (the schedule's per-chunk interleaving is
    in the bubble, not in the per-rank compute)."""
    return [len(r["layers"]) for r in rank_layers(spec, lay.pp, lay.pp_virtual_stages, lay.pp_schedule, w.seq_len)]


def _slowest_stage(spec, cluster: Cluster, w: Workload, lay: Layout, eff: float):
    """(op times, one attention layer's forward s, pp rank, its params, its mixers) of the pipeline rank with the
    longest forward + backward: it sets the pipeline's pace. Every rank is timed from its own
    blocks (dense / MoE / MTP, the head where it sits: DualPipeV's is on rank 0), as the trainer
    splits them (``pipeline.rank_layers``)."""
    ranks = rank_layers(spec, lay.pp, lay.pp_virtual_stages, lay.pp_schedule, w.seq_len)
    best, seen = None, {}
    for r, info in enumerate(ranks):
        prm = rank_params(spec, info["layers"], info["embedding"], info["head"], len(ranks))
        key = (len(info["layers"]) - prm["moe_layers"], prm["moe_layers"], info["head"], eff,
               stage_mixers(spec, info["layers"]))
        if key not in seen:  # ranks of the same composition take the same time
            seen[key] = stage_op_times(spec, cluster, w.seq_len, lay, *key)
        ops, t_attn = seen[key]
        if best is None or ops.fwd + ops.bwd > best[0].fwd + best[0].bwd:
            best = (ops, t_attn, r, prm, key[-1])
    return best


def estimate_step_time(spec, cluster: Cluster, w: Workload, lay: Layout) -> StepEstimate:
    """The step time model of this module's docstring for one layout (seconds)."""
    acc = cluster.accelerator
    eff = getattr(acc, "compute_efficiency", 0.0)
    m = microbatches(lay, w)
    ops, t_attn_layer, _, prm, mixers = _slowest_stage(spec, cluster, w, lay, eff)
    n_layers, n_moe = prm["moe_layers"] + prm["dense_layers"], prm["moe_layers"]
    local = {"dense": prm["dense"] / lay.tp, "expert": prm["expert"] / (lay.etp * lay.ep),
             "moe_layers": n_moe, "layers": n_layers}
    c = estimate_axis_comm(spec, cluster, w, lay, local)

    t_fwd_c, t_bwd_c = ops.fwd, ops.bwd
    rc_frac = recompute_fraction(lay.ac, spec.n_layers)
    t_rc = rc_frac * t_fwd_c + recompute_attention_share(lay.ac, spec) * ops.attn_fwd  # planner.ac_memory
    t_bwd_layer = t_bwd_c / max(n_layers, 1)

    fwd = {"tp": n_layers * c["tp_fwd"], "ep": n_moe * c["ep_fwd"], "pp": lay.pp_virtual_stages * c["pp"],
           "zero": max(0.0, c["zero_fwd"] - t_fwd_c)}
    bwd = {"tp": n_layers * max(0.0, c["tp_bwd"] - 0.5 * t_bwd_layer), "ep": n_moe * c["ep_bwd"],
           "pp": lay.pp_virtual_stages * c["pp"], "zero": max(0.0, c["zero_bwd"] - t_bwd_c - t_rc)}
    if in_slice_tp(cluster, lay):  # collective matmul: TP under the layer's own GEMMs (torus.py)
        per = max(n_layers, 1)
        f_tp, b_tp = torus_tp_exposed(c["tp_fwd"], c["tp_bwd"], ops.gemm_fwd / per, ops.gemm_bwd / per)
        fwd["tp"], bwd["tp"] = n_layers * f_tp, n_layers * b_tp
    # each mixer's own cp traffic: ring / Ulysses for softmax layers, state passing for linear ones
    cp_args = (spec, Links(cluster, lay), mixers, lay.microbatch, w.seq_len, lay.cp, lay.tp, w.act_bytes, lay.cp_impl)
    fwd["cp"], bwd["cp"] = cp_stage_seconds(*cp_args, t_attn_layer)
    raw_f, raw_b = cp_stage_seconds(*cp_args, 0.0)  # before overlap, per layer as raw_comm keeps it
    c["cp_fwd"], c["cp_bwd"] = raw_f / max(n_layers, 1), raw_b / max(n_layers, 1)
    t_f = t_fwd_c + sum(fwd.values())
    t_b = t_bwd_c + t_rc + sum(bwd.values())
    pipe = estimate_pipeline_time(t_f, t_b, lay.pp, m, lay.pp_schedule, lay.pp_virtual_stages)

    dp_exposed = max(0.0, c["dp_grad"] - t_bwd_c) + max(0.0, c["dp_param"] - t_fwd_c)
    pb, gb, kb = PRECISIONS[w.precision]
    n_sh = lay.dp_shard * lay.cp if lay.zero_stage >= 1 else 1
    local_params = local["dense"] + local["expert"]
    opt_bytes = local_params * (2 * kb / n_sh + gb / (n_sh if lay.zero_stage >= 2 else 1) + pb)
    t_opt = optimizer_seconds(opt_bytes, acc, eff)

    parts = {"compute": m * (t_fwd_c + t_bwd_c), "recompute": m * t_rc}
    for k in ("tp", "cp", "ep", "pp", "zero"):
        parts[f"{k}_comm"] = m * (fwd[k] + bwd[k])
    parts["bubble"] = pipe["bubble"]
    parts["dp_comm"] = dp_exposed
    parts["optimizer"] = t_opt
    step = sum(parts.values())
    raw = {k: v for k, v in c.items() if k != "links"}
    est = StepEstimate(step, parts, t_f, t_b, m, c["links"], raw, n_layers)
    est.compute_s = {"gemm": m * (ops.gemm_fwd + ops.gemm_bwd + ops.head_fwd + ops.head_bwd),
                     "attention": m * (ops.attn_fwd + ops.attn_bwd), "memory_bound": m * (ops.mem_fwd + ops.mem_bwd)}
    return est


def estimate_training_days(total_flops: float, gpus: int, peak_flops_per_s: float, mfu: float) -> float:
    """Days to spend ``total_flops`` on ``gpus`` devices at ``mfu`` of their peak (FLOP/s).

    The seed's example: 3.8e25 FLOPs on 16,384 H100 (989.4 TFLOP/s) at 40% MFU is about 68 days.
    Raises ValueError if a rate is not positive.
    """
    rate = gpus * peak_flops_per_s * mfu
    if rate <= 0:
        raise ValueError(f"gpus * peak * mfu ({rate}) must be positive")
    return total_flops / rate / 86400.0
