"""What the trainer accounting keeps per (microbatch, chunk) under block checkpointing, on the
layout of docs/rehearsal.md's Round 4 (Llama 3 405B, PP16 x TP8 + SP x DP64, interleaved v = 8,
``E|(t|)*126,L``, full checkpointing, 32 microbatches): each block's input, the (1, 8192/8, 16384)
bf16 residual shard, 32 MiB, and once per chunk the regions' RoPE tables, cos and sin (8192, 64)
float32, 4 MiB (measured in the rehearsal: 4 MiB of ``index`` outputs per chunk forward).
Stage 1 holds eight one-block chunks with 141 chunk-microbatches in flight (Megatron's warm-up
count 2 (p - 1) + (v - 1) p + 1); stage 0's first chunk is the embedding alone (no tables)."""
from __future__ import annotations

import pytest

from ndtrain.calibration.calibrate import trainer_layout
from ndtrain.config import load_config
from ndtrain.planner.layout import Workload, microbatches
from ndtrain.planner.memory import _block_counts, rank_params
from ndtrain.planner.model_spec import from_model_config
from ndtrain.planner.pipeline import inflight_microbatches, rank_layers
from ndtrain.planner.trainer_memory import trainer_rank_breakdown

MiB = 2**20
R4 = {"parallel.tp": "8", "parallel.sequence_parallel": "true", "parallel.pp": "16", "parallel.zero_stage": "1",
      "parallel.pp_schedule": "interleaved", "parallel.pp_virtual_stages": "8", "training.micro_batch_size": "1"}


def _activations(stage: int, ac: str) -> tuple[float, float]:
    """(stage's activations in bytes, its in-flight chunk-microbatches) under ``ac``."""
    cfg = load_config("llama3_405b", {**R4, "training.activation_checkpoint": ac}, world_size=8192)
    spec, lay = from_model_config(cfg.model), trainer_layout(cfg, 8192)
    w = Workload(seq_len=8192, global_batch_tokens=2048 * 8192, precision="fp32", act_bytes=2, memory_model="trainer")
    m, ranks = microbatches(lay, w), rank_layers(spec, 16, 8, "interleaved", 8192)
    info = ranks[stage]
    prm = rank_params(spec, info["layers"], info["embedding"], info["head"], len(ranks))
    n_layers, n_moe = _block_counts(spec, info, prm)
    inflight = inflight_microbatches(16, m, "interleaved", 8, stage=stage)
    bd = trainer_rank_breakdown(spec, w, lay, prm, n_layers, n_moe, info["head"], inflight, m, 8192)
    return bd["activations"], inflight * 8


def test_full_checkpointing_keeps_block_inputs_and_each_chunks_rope_tables():
    act, chunk_mbs = _activations(1, "full")
    assert chunk_mbs == 141
    assert act == pytest.approx(141 * (32 + 4) * MiB, rel=1e-12)  # without the tables: 141 x 32 MiB
    act0, chunk_mbs0 = _activations(0, "full")
    assert act0 == pytest.approx(chunk_mbs0 / 8 * 7 * (32 + 4) * MiB, rel=1e-12)  # 7 block chunks of 8


def test_no_checkpointing_keeps_no_separate_tables():
    """Under none the blocks' own bf16 casts of cos / sin are the per-block ``rope`` term; the fp32
    tables are freed after the forward, so nothing is added per chunk."""
    from ndtrain.planner.trainer_memory import trainer_layer_bytes

    act, chunk_mbs = _activations(1, "none")
    cfg = load_config("llama3_405b", R4, world_size=8192)
    block = trainer_layer_bytes(from_model_config(cfg.model), 8192, 8192, tp=8, sp=True, kind="lowp", e=2)
    assert act == pytest.approx(chunk_mbs * block["total"], rel=1e-12)
