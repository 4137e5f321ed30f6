"""The configuration sweep's share of the default test suite (``ndtrain.tools.sweep.SUBSET``, run by
tests/integration/test_sweep.py): (feature, world, parallel overrides, zero / ac / dtype / fused)."""
from __future__ import annotations

# the default test suite's share (tests/integration/test_sweep.py): every axis, schedule, model
# feature, ZeRO stage, checkpointing policy and dtype at least once, on 1 or 2 ranks, and one
# representative of each composition made to work lately (EP x ZeRO-3, MoE x TP with split experts,
# MLA + MTP x CP, linear mixers x CP / TP, MTP x ZeRO-3, MTP x DualPipeV, fused loss x PP, the shared
# expert under the dispatch all-to-all, hierarchical dispatch)
_PP = {"pp": 2, "pp_virtual_stages": 1}
SUBSET = (
    ("dense", 2, {"dp_shard": 2}, {"zero": 2}),
    ("dense", 2, {"dp_replicate": 2}, {"zero": 3, "dtype": "bfloat16"}),
    ("mla", 2, {"tp": 2}, {"zero": 1, "ac": "selective"}),
    ("moe", 2, {"tp": 2, "sequence_parallel": True, "expert_tp": 2}, {"zero": 0}),
    ("hybrid", 2, {"tp": 2}, {"zero": 1, "ac": "full"}),  # each mixer split by heads
    ("hybrid", 2, {"cp": 2, "cp_impl": "ring"}, {"zero": 3, "ac": "selective"}),  # state passing
    ("dense", 2, {"cp": 2, "cp_impl": "ulysses"}, {"zero": 0, "ac": "every:2"}),
    ("tied", 2, {**_PP, "pp_schedule": "1f1b"}, {"zero": 1, "fused": True}),  # head + tied embedding
    ("dense", 2, {**_PP, "pp_schedule": "gpipe"}, {"zero": 0, "ac": "sqrt"}),
    ("dense", 2, {"pp": 2, "pp_schedule": "interleaved", "pp_virtual_stages": 2}, {"zero": 2}),
    ("dense", 2, {**_PP, "pp_schedule": "zero_bubble"}, {"zero": 3}),
    ("mtp", 2, {**_PP, "pp_schedule": "dualpipev"}, {"zero": 1}),  # MoE-free MTP, V
    ("moe", 2, {"dp_shard": 2, "ep": 2}, {"zero": 3}),
    ("moe_shared", 2, {"dp_shard": 2, "ep": 2, "moe_shared_overlap": True}, {"zero": 1}),
    ("moe", 2, {"dp_shard": 2, "ep": 2, "moe_dispatch": "hierarchical", "node_size": 1}, {"zero": 1}),
    ("moe", 2, {"dp_shard": 2}, {"zero": 3, "dtype": "float16"}),
    ("moe_balanced", 2, {"cp": 2, "ep": 2, "cp_impl": "ring"}, {"zero": 1}),  # round-robin by global position
    ("deepseek", 2, {"cp": 2, "cp_impl": "ring"}, {"zero": 1}),  # MLA + MTP (+ MoE) over cp
    ("mtp", 2, {"dp_replicate": 2}, {"zero": 2, "dtype": "float32"}),
    ("mtp", 2, {"dp_shard": 2}, {"zero": 3}),  # each MTP depth an FSDP unit
    ("lora", 2, {"tp": 2, "sequence_parallel": True}, {"zero": 0}),  # adapters split like their base
    ("lora", 2, {"dp_shard": 2}, {"zero": 3, "ac": "full"}),
    ("packed", 2, {"cp": 2, "cp_impl": "ulysses"}, {"zero": 3, "ac": "full"}),  # documents cut by cp
    ("packed", 2, {**_PP, "pp_schedule": "1f1b"}, {"zero": 1}),  # documents split by microbatch
    ("muon", 2, {"tp": 2, "sequence_parallel": True}, {"zero": 0}),  # whole-matrix Newton-Schulz over tp
    ("deepseek", 2, {"tp": 2, "sequence_parallel": True}, {"zero": 1, "ac": "deepseek"}),  # norms + MLA latents
    ("dense", 2, {"dp_shard": 2}, {"zero": 3, "ac": "deepseek"}),  # recipes recompute with gathered weights
    ("dense", 2, {"cp": 2, "cp_impl": "ring"}, {"zero": 0, "ac": "core_attn"}),  # ring core recomputed
    ("moe", 2, {"dp_shard": 2}, {"zero": 3, "ac": "op"}),
)
