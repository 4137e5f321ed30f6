"""The planner: predict memory, communication, bubbles, MFU and training time; search layouts.

Pure Python (no process groups, no torch outside ``measure``), so it runs on a laptop for a
16,384-GPU cluster. See docs/planner.md for the model, its formulas, sources and assumptions.

    from ndtrain.planner import load_model_spec, get_accelerator, Cluster, Workload, parse_layout
    spec, _ = load_model_spec("llama3_405b")
    plan = evaluate(spec, Cluster(get_accelerator("H100"), 8192), Workload(8192, 2048 * 8192),
                    parse_layout("tp=8,pp=16,dp_shard=64,zero_stage=2,pp_schedule=interleaved,pp_virtual_stages=8"))
    plan.mfu, plan.memory.total, plan.fits
"""
from ndtrain.planner.hardware import HARDWARE, Accelerator, Cluster, get_accelerator
from ndtrain.planner.layout import Layout, Workload, check_layout, parse_layout
from ndtrain.planner.memory import (
                                    PRECISIONS,
                                    estimate_activation_bytes_per_layer,
                                    estimate_memory,
                                    estimate_state_bytes_per_param,
)
from ndtrain.planner.model_spec import ModelSpec, estimate_training_flops, from_hf_config, load_model_spec
from ndtrain.planner.search import Plan, evaluate, explain, recommend, search
from ndtrain.planner.timing import estimate_step_time, estimate_training_days

__all__ = [
                                    "HARDWARE",
                                    "PRECISIONS",
                                    "Accelerator",
                                    "Cluster",
                                    "Layout",
                                    "ModelSpec",
                                    "Plan",
                                    "Workload",
                                    "check_layout",
                                    "estimate_activation_bytes_per_layer",
                                    "estimate_memory",
                                    "estimate_state_bytes_per_param",
                                    "estimate_step_time",
                                    "estimate_training_days",
                                    "estimate_training_flops",
                                    "evaluate",
                                    "explain",
                                    "from_hf_config",
                                    "get_accelerator",
                                    "load_model_spec",
                                    "parse_layout",
                                    "recommend",
                                    "search",
]
