"""LoRA under data and tensor parallelism: after 4 AdamW steps the adapters of every layout equal
the single-process run's (float64, 1e-8 relative: only the order of float64 sums differs across
ranks, seen about 1e-14), and the
frozen base never moves (bitwise). One spawned group of 2 gloo ranks runs every layout."""
from __future__ import annotations

import torch

from ndtrain.mesh import ParallelDims
from ndtrain.model.lora import is_adapter
from ndtrain.train.loop import Trainer
from tests.dist_utils import run_ranks
from tests.parallel.layout_parity import global_batch
from tests.utils import rel_err, tiny_config

STEPS = 4
TARGETS = "*.wq,*.wk,*.wv,*.wo,*.w1,*.w2,*.w3"
LAYOUTS = {  # name: parallel section on 2 ranks
    "ddp": {"dp_shard": 2},
    "zero1": {"dp_shard": 2, "zero_stage": 1},
    "zero3": {"dp_shard": 2, "zero_stage": 3},
    "tp2": {"tp": 2},
    "tp2_sp": {"tp": 2, "sequence_parallel": True},
    "pp2": {"pp": 2},
    "cp2": {"cp": 2, "cp_impl": "ring"},
}


def _cfg(world: int, ac: str = "none", **par):
    return tiny_config({"finetune.lora_rank": 4, "finetune.lora_alpha": 8.0, "finetune.lora_targets": TARGETS,
                        "training.activation_checkpoint": ac}, world=world, parallel=par)


def _whole(state: dict) -> dict:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}


def _train(cfg, world: int) -> tuple[dict, dict]:
    """(this rank's frozen parameters before, the whole model state after STEPS steps) of a trainer
    on ``cfg``; each rank takes its dp slice of the same global batches. The state is read only at
    the end: torch's ``get_optimizer_state_dict`` on an optimizer without state takes a zero-LR
    step to create it, which shifts AdamW's step count (bias correction) of the plain layouts."""
    mesh = ParallelDims.from_config(cfg.parallel, world).build_mesh()
    tr = Trainer(cfg, mesh, torch.device("cpu"))
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters() if not p.requires_grad}
    dp = mesh.group("dp")
    for step in range(STEPS):
        inputs, labels = global_batch(step)
        n = inputs.shape[0] // dp.size
        tr.step(inputs[dp.rank * n:(dp.rank + 1) * n], labels[dp.rank * n:(dp.rank + 1) * n])
    moved = [n for n, p in tr.model.named_parameters() if n in before and not torch.equal(p, before[n])]
    return moved, _whole(tr.tensor_state()["model"])


def _world2(rank: int, world: int) -> dict:
    ref_moved, ref = _train(_cfg(1), 1)
    assert ref_moved == []
    out = {"ref_keys": sorted(ref)}
    for name, par in LAYOUTS.items():
        moved, after = _train(_cfg(world, ac="full" if name == "zero3" else "none", **par), world)
        out[name] = {
            "keys": sorted(after),  # a pipeline stage holds its own layers' tensors only
            "adapter_err": max(rel_err(after[k], ref[k]) for k in after if is_adapter(k)),
            "base_moved": moved,
            "base_equal": all(torch.equal(after[k], ref[k]) for k in after if not is_adapter(k)),
            "adapters_moved": min(after[k].abs().max().item() for k in after if k.endswith("lora_B")),  # B starts at 0
        }
    return out


def test_lora_adapters_match_single_process_and_base_stays_frozen():
    """DDP, ZeRO-1, ZeRO-3 (+ full activation checkpointing), tp2, tp2 + SP, pp2 and cp2 train the
    same adapters as one process to 1e-8; no base tensor changes by a single bit."""
    res = run_ranks(_world2, 2, timeout_s=400)
    ref_keys = res[0].pop("ref_keys")
    assert sum(is_adapter(k) for k in ref_keys) == 2 * 7 * 2  # 2 layers x 7 linears x (A, B)
    for name in LAYOUTS:
        assert sorted(set(res[0][name]["keys"]) | set(res[1][name]["keys"])) == ref_keys, name
    for r0 in res:
        r0.pop("ref_keys", None)
        for name, r in r0.items():
            assert r["adapter_err"] < 1e-8, (name, r["adapter_err"])
            assert r["base_moved"] == [] and r["base_equal"], (name, r["base_moved"])
            assert r["adapters_moved"] > 1e-4, (name, r["adapters_moved"])
