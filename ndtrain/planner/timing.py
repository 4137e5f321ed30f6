"""Step time of a layout: compute, communication after overlap, pipeline bubble, optimizer.

Compute (per microbatch on the slowest pipeline stage, per rank): dense matmuls 2 * N_active *
tokens / tp forward and twice that backward; FlashAttention executes the causal half of the
T x T pairs, forward 2 matmuls, backward 5 (it recomputes QK^T: Dao 2023). Dense work runs at
``COMPUTE_EFFICIENCY`` x peak (one global constant, see hardware.py), attention at that rate times
the accelerator's published FlashAttention / GEMM throughput ratio. Recompute adds the forward of
the checkpointed blocks (selective: the attention core). Under ``dtype=float8`` only the blocks'
linear layers run at the FP8 peak; attention and the output head run at the bf16 peak
(``Cluster.precision_note``).

Overlap assumptions (stated, the same for every case):
  * TP / SP collectives: forward ones are exposed (they sit between dependent GEMMs); backward ones
    overlap with the weight-gradient GEMMs (half the backward), as in Megatron-LM's asynchronous TP
    communication (Narayanan 2021, Korthikanti 2022); the excess is exposed.
  * CP ring (Liu 2023): each K/V block exchange overlaps with the previous block's attention; the
    excess over attention compute is exposed. All-gather CP (Llama 3) and Ulysses are exposed.
  * EP all-to-all and PP send / recv are exposed (on the critical path of each microbatch).
  * ZeRO-3 gathers are prefetched under the forward / backward of the microbatch; ZeRO-2's
    reduce-scatters overlap with the backward that produces them; the excess is exposed.
  * The data-parallel gradient reduction after the last microbatch overlaps with that microbatch's
    backward (bucketed DDP, Li et al. 2020); ZeRO-1/2's weight all-gather with the next forward.
  * Optimizer step: memory-bound, reads and writes the local state once at HBM bandwidth.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ndtrain.planner.comm import estimate_axis_comm
from ndtrain.planner.hardware import COMPUTE_EFFICIENCY, Cluster
from ndtrain.planner.layout import Layout, Workload, microbatches
from ndtrain.planner.memory import PRECISIONS, recompute_fraction, stage_params
from ndtrain.planner.pipeline import estimate_pipeline_time, partition_layers


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


def stage_layout(spec, lay: Layout, w: Workload | None = None, attention_ratio: float = 0.5) -> list[int]:
    """Blocks per pipeline stage, balanced by time with the head's cost on the last stage."""
    if lay.pp == 1:
        return [spec.n_layers]
    layer = 6.0 * spec.layer_params(spec.is_moe, active=True)
    if w is not None:  # executed attention (causal half, fwd 1 + bwd 2.5) at its relative speed
        layer += spec.attention_flops_per_layer(w.seq_len) / 6.0 * 3.5 / attention_ratio
    return partition_layers(spec.n_layers, lay.pp, head_cost=6.0 * spec.vocab_size * spec.dim / layer)


def _stage_flops(spec, w: Workload, lay: Layout, prm: dict, n_layers: int, last: bool) -> dict:
    """Forward FLOPs per microbatch per rank of one stage: dense matmuls (``lin``: the blocks' linear
    layers, ``head``: the output head passes) and executed attention."""
    tokens = lay.microbatch * w.seq_len / lay.cp
    n_moe = prm["moe_layers"]
    active = (n_layers - n_moe) * spec.layer_params(False) + n_moe * spec.layer_params(True, active=True)
    if last:  # head, and the MTP modules (each: a block, its projection and the head again)
        active += (1 + spec.mtp_depth) * spec.vocab_size * spec.dim + spec.mtp_params(active=True)
    head = (1 + spec.mtp_depth) * spec.vocab_size * spec.dim if last else 0
    dense = 2.0 * active * tokens / lay.tp
    per_layer_attn = spec.attention_flops_per_layer(w.seq_len) / 6.0  # causal half of fwd
    attn = (n_layers + (spec.mtp_depth if last else 0)) * per_layer_attn * tokens / lay.tp
    return {"dense": dense, "lin": dense - 2.0 * head * tokens / lay.tp, "head": 2.0 * head * tokens / lay.tp,
            "attn": attn, "attn_layer": per_layer_attn * tokens / lay.tp}


def estimate_step_time(spec, cluster: Cluster, w: Workload, lay: Layout) -> StepEstimate:
    """The step time model of this module's docstring for one layout (seconds)."""
    ratio = cluster.accelerator.attention_gemm_ratio
    stages = stage_layout(spec, lay, w, ratio)
    m = microbatches(lay, w)
    peak = cluster.peak_flops_per_s * COMPUTE_EFFICIENCY  # block linears (FP8 under float8)
    peak_hi = cluster.mfu_peak_flops_per_s * COMPUTE_EFFICIENCY  # head (and attention): 16-bit
    peak_attn = peak_hi * ratio

    def t_dense(fl):
        return fl["lin"] / peak + fl["head"] / peak_hi

    best = None  # the slowest stage sets the pipeline's pace
    for s in sorted({0, len(stages) - 1, max(range(len(stages)), key=lambda i: stages[i])}):
        prm = stage_params(spec, stages, s)
        fl = _stage_flops(spec, w, lay, prm, stages[s], s == len(stages) - 1)
        t = t_dense(fl) + fl["attn"] / peak_attn
        if best is None or t > best[0]:
            best = (t, s, prm, fl)
    _, s, prm, fl = best
    n_layers, n_moe = stages[s], prm["moe_layers"]
    local = {"dense": prm["dense"] / lay.tp, "expert": prm["expert"] / (lay.tp * lay.ep),
             "moe_layers": n_moe, "layers": n_layers}
    c = estimate_axis_comm(spec, cluster, w, lay, local)

    t_attn_layer = fl["attn_layer"] / peak_attn
    t_fwd_c = t_dense(fl) + fl["attn"] / peak_attn
    t_bwd_c = 2 * t_dense(fl) + 2.5 * fl["attn"] / peak_attn
    rc_frac = recompute_fraction(lay.ac, spec.n_layers)
    t_rc = rc_frac * t_fwd_c + (fl["attn"] / peak_attn if lay.ac == "selective" else 0.0)
    t_bwd_layer = t_bwd_c / max(n_layers, 1)

    fwd = {"tp": n_layers * c["tp_fwd"], "ep": n_moe * c["ep_fwd"], "pp": lay.pp_virtual_stages * c["pp"],
           "zero": max(0.0, c["zero_fwd"] - t_fwd_c)}
    bwd = {"tp": n_layers * max(0.0, c["tp_bwd"] - 0.5 * t_bwd_layer), "ep": n_moe * c["ep_bwd"],
           "pp": lay.pp_virtual_stages * c["pp"], "zero": max(0.0, c["zero_bwd"] - t_bwd_c - t_rc)}
    if lay.cp_impl == "ring":
        fwd["cp"] = n_layers * max(0.0, c["cp_fwd"] - t_attn_layer)
        bwd["cp"] = n_layers * max(0.0, c["cp_bwd"] - 2.5 * t_attn_layer)
    else:
        fwd["cp"], bwd["cp"] = n_layers * c["cp_fwd"], n_layers * c["cp_bwd"]
    t_f = t_fwd_c + sum(fwd.values())
    t_b = t_bwd_c + t_rc + sum(bwd.values())
    pipe = estimate_pipeline_time(t_f, t_b, lay.pp, m, lay.pp_schedule, lay.pp_virtual_stages)

    dp_exposed = max(0.0, c["dp_grad"] - t_bwd_c) + max(0.0, c["dp_param"] - t_fwd_c)
    pb, gb, kb = PRECISIONS[w.precision]
    n_sh = lay.dp_shard * lay.cp if lay.zero_stage >= 1 else 1
    local_params = local["dense"] + local["expert"]
    opt_bytes = local_params * (2 * kb / n_sh + gb / (n_sh if lay.zero_stage >= 2 else 1) + pb)
    t_opt = opt_bytes / cluster.accelerator.hbm_bytes_per_s

    parts = {"compute": m * (t_fwd_c + t_bwd_c), "recompute": m * t_rc}
    for k in ("tp", "cp", "ep", "pp", "zero"):
        parts[f"{k}_comm"] = m * (fwd[k] + bwd[k])
    parts["bubble"] = pipe["bubble"]
    parts["dp_comm"] = dp_exposed
    parts["optimizer"] = t_opt
    step = sum(parts.values())
    raw = {k: v for k, v in c.items() if k != "links"}
    return StepEstimate(step, parts, t_f, t_b, m, c["links"], raw, n_layers)


def estimate_training_days(total_flops: float, gpus: int, peak_flops_per_s: float, mfu: float) -> float:
    """Days to spend ``total_flops`` on ``gpus`` devices at ``mfu`` of their peak (FLOP/s).

    The seed's example: 3.8e25 FLOPs on 16,384 H100 (989.4 TFLOP/s) at 40% MFU is about 68 days.
    Raises ValueError if a rate is not positive.
    """
    rate = gpus * peak_flops_per_s * mfu
    if rate <= 0:
        raise ValueError(f"gpus * peak * mfu ({rate}) must be positive")
    return total_flops / rate / 86400.0
