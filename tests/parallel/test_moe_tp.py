"""MoE layers under tensor parallel (``ndtrain.parallel.tp.moe_layers``) against the single process.

One spawn of 4 gloo ranks runs every layout, each 10 float64 AdamW steps (clipping active):

* the ``moe_debug`` preset shrunk (8 softmax-routed experts, top-2, renormalised) with every
  statistic the layout could break switched on: Switch (microbatch scope), sequence-wise and z
  losses, the aux-loss-free bias update, capacity dropping (factor 1.0) and a gated shared expert;
  under ``tp2 x ep2`` (dp_shard 2, ep borrowing it) with ``parallel.expert_tp`` 1 and 2, with and
  without sequence parallel;
* the ``hybrid_debug`` preset shrunk (Gated DeltaNet + softmax attention, MoE with a shared
  expert) under ``tp2 x dp2``.

Reference: the world-size-1 ``Trainer`` in each rank on the whole global batch, with
``micro_batch_size`` = the layouts' local batch so its microbatches are the ranks' (the Switch loss
and the capacity are per microbatch). Compared per step: loss, aux loss, grad norm, load metrics and
every gradient the optimizer applies (this rank's ep block of experts, its tp slice of split
weights); at the end every parameter, the expert biases (bitwise: sign updates of equal integer
loads), the checkpoint view (``gather_tp_state``: global names and shapes, ep DTensors kept) and its
round trip, and once the model gathered on rank 0 (``rundir.gather_model``, the HF export path).
Tolerance 1e-6 relative (the issue's contract): the layouts only reorder sums (tp all-reduces,
the row all-gather / reduce-scatter of split experts, all-to-alls), ~1e-13 in float64; a token
routed on the wrong rank, a missing tp gradient sum or a statistic over a tp slice is O(1e-2) off.
"""
from __future__ import annotations

import pytest
import torch

from ndtrain.config import ConfigError, apply_overrides, validate
from ndtrain.mesh import ParallelDims
from ndtrain.model.moe import moe_layers
from ndtrain.parallel.tp.tensor_parallel import tp_local_slice, tp_specs
from ndtrain.train.loop import Trainer
from tests.dist_utils import run_ranks
from tests.parallel.layout_parity import STEPS, G, V, global_batch
from tests.utils import rel_err, tiny_config

MOE = {"model.vocab_size": V, "model.dim": 32, "model.n_heads": 4, "model.n_kv_heads": 2, "model.ffn_hidden": 48,
       "model.max_seq_len": 64, "model.moe_ffn_hidden": 16, "model.moe_shared_experts": 1,
       "model.moe_shared_gate": True, "model.moe_seq_aux_loss_coef": 0.01, "model.moe_bias_update_rate": 0.01,
       "model.moe_capacity_factor": 1.0, "model.init_std": 0.1}
HYBRID = {"model.vocab_size": V, "model.dim": 32, "model.n_heads": 4, "model.n_kv_heads": 2, "model.ffn_hidden": 48,
          "model.max_seq_len": 64, "model.layer_pattern": "GA", "model.n_layers": 2, "model.linear_chunk_size": 3,
          "model.linear_heads": 2, "model.linear_key_head_dim": 8, "model.linear_value_heads": 4,
          "model.linear_value_head_dim": 8, "model.moe_ffn_hidden": 32}
LAYOUTS = {
    "ep2_etp1": ("moe_debug", {"tp": 2, "ep": 2, "expert_tp": 1}),
    "ep2_etp2": ("moe_debug", {"tp": 2, "ep": 2, "expert_tp": 2}),
    "ep2_etp1_sp": ("moe_debug", {"tp": 2, "ep": 2, "expert_tp": 1, "sequence_parallel": True}),
    "ep2_etp2_sp": ("moe_debug", {"tp": 2, "ep": 2, "expert_tp": 2, "sequence_parallel": True}),
    "hybrid_dp2": ("hybrid_debug", {"tp": 2}),
}
METRICS = ("loss", "aux_loss", "grad_norm", "moe_load_max_mean", "moe_dropped_frac", "moe_tokens_per_expert_max")


def _cfg(preset: str, world: int, micro: int = 0, **par):
    return tiny_config(MOE if preset == "moe_debug" else HYBRID, world=world, preset=preset,
                       training={"micro_batch_size": micro}, parallel={"dp_shard": -1, **par})


def _train(cfg, world: int) -> dict:
    from tests.parallel.layout_parity import _record_grads

    mesh = ParallelDims.from_config(cfg.parallel, world).build_mesh()
    tr = Trainer(cfg, mesh, torch.device("cpu"))
    grads: list = []
    _record_grads(tr, grads)
    dp = mesh.group("dp")
    local = G // dp.size
    sl = slice(dp.rank * local, (dp.rank + 1) * local)
    steps = []
    for s in range(STEPS):
        mesh.reset_stats()
        steps.append(tr.step(*(x[sl] for x in global_batch(s))))
    return {"tr": tr, "mesh": mesh, "steps": steps, "grads": grads,
            "bias": [m.expert_bias.clone() for m in moe_layers(tr.model)], "tp_bytes": mesh.reset_stats()}


def _expected(tr, mesh, name: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of a whole reference tensor: its ep block of experts, then its tp slice."""
    ep = mesh.group("ep")
    if ".experts." in name and ep.size > 1:
        el = full.shape[0] // ep.size
        full = full[ep.rank * el:(ep.rank + 1) * el]
    return tp_local_slice(full, tp_specs(tr.model).get(name), mesh.group("tp"))


def _checkpoint_view(tr, mesh, ref_params: dict, roundtrip: bool = True) -> dict:
    """``gather_tp_state``: global names and shapes equal to the reference; scatter inverts it
    (``roundtrip``: DDP's plain local tensors; a ZeRO layout's round trip is its DCP load)."""
    from ndtrain.parallel.tp.state import gather_tp_state, scatter_tp_state

    local = dict(tr.dp.model_state_dict())
    full = gather_tp_state({"model": dict(local)}, tr.model, mesh)["model"]
    whole = {n: v.full_tensor() if hasattr(v, "full_tensor") else v for n, v in full.items()}
    out = {"names": sorted(whole) == sorted(ref_params),
           "shapes": all(whole[n].shape == p.shape for n, p in ref_params.items()),
           "ckpt": max(rel_err(whole[n], p) for n, p in ref_params.items())}
    if roundtrip:
        back = scatter_tp_state({"model": full}, tr.model, mesh)["model"]
        loc = (lambda v: v.to_local() if hasattr(v, "to_local") else v)
        out["roundtrip"] = max(rel_err(loc(back[n]), loc(v)) for n, v in local.items())
    return out


def _compare(run: dict, ref: dict) -> dict:
    tr, mesh = run["tr"], run["mesh"]
    out = {k: 0.0 for k in METRICS + ("grad", "param")}
    for d, r in zip(run["steps"], ref["steps"]):
        for k in METRICS:
            out[k] = max(out[k], abs(d[k] - r[k]) / max(abs(r[k]), 1e-30))
    for g, rg in zip(run["grads"], ref["grads"]):
        assert g.keys() == rg.keys()
        for n, t in g.items():
            out["grad"] = max(out["grad"], rel_err(t, _expected(tr, mesh, n, rg[n])))
    for n, p in tr.model.named_parameters():
        out["param"] = max(out["param"], rel_err(p.detach(), _expected(tr, mesh, n, ref["params"][n])))
    out["bias_equal"] = all(torch.equal(a, b) for a, b in zip(run["bias"], ref["bias"]))
    out["dropped"] = ref["steps"][-1]["moe_dropped_frac"]
    out["split"] = sorted(n for n in tp_specs(tr.model) if ".experts." in n or ".shared." in n)
    out["repr"] = repr(tr.model)
    out.update(_checkpoint_view(tr, mesh, ref["params"]))
    return out


def _reference(preset: str, micro: int) -> dict:
    run = _train(_cfg(preset, 1, micro), 1)
    run["params"] = {n: p.detach().clone() for n, p in run["tr"].dp.model_state_dict().items()}  # + expert_bias
    return run


def _rank(rank: int, world: int) -> dict:
    from ndtrain.train.rundir import gather_model

    torch.set_num_threads(1)
    refs, out = {}, {}
    for name, (preset, par) in LAYOUTS.items():
        cfg = _cfg(preset, world, **par)
        run = _train(cfg, world)
        local = G // run["mesh"].dims.dp
        if preset not in refs:
            refs[preset] = _reference(preset, local)
        out[name] = _compare(run, refs[preset])
        if name == "ep2_etp2":  # the trained model whole on rank 0 (generation, HF export)
            model = gather_model(run["tr"], cfg)
            if rank == 0:
                sd = model.state_dict()
                out["gathered"] = max(rel_err(sd[n], p) for n, p in refs[preset]["params"].items())
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_rank, 4)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_under_tp_matches_single_process(results, layout):
    for per_rank in results:
        r = per_rank[layout]
        for key in METRICS + ("grad", "param", "ckpt"):
            assert r[key] < 1e-6, (layout, key, r[key])
        assert r["bias_equal"] and r["names"] and r["shapes"] and r["roundtrip"] == 0.0, r
        assert "TensorParallelMoE" in r["repr"], "the MoE layers run their tp form"
        split = [n for n in r["split"] if ".experts." in n]
        etp = LAYOUTS[layout][1].get("expert_tp", 1)
        assert len(split) == (3 * 2 if etp == 2 else 0), split  # w1 w3 w2 of both MoE layers, or none
        assert any(".shared.w2" in n for n in r["split"]), r["split"]  # shared experts split like an FFN
    if LAYOUTS[layout][0] == "moe_debug":
        assert results[0][layout]["dropped"] > 0, "capacity should drop tokens"
    assert results[0]["gathered"] < 1e-6


def test_moe_tp_rules():
    """expert_tp fits the stage (else the folded mesh); split experts need F % expert_tp; the sequence
    splits into cp x tp pieces."""
    cfg = _cfg("moe_debug", 2, tp=2)
    for over, words in (({"parallel.expert_tp": 4}, r"ep\*expert_tp \(4\) does not divide the ranks of a pp stage"),
                        ({"parallel.expert_tp": 2, "model.moe_ffn_hidden": 15}, r"moe_ffn_hidden \(15\)"),
                        ({"data.seq_len": 15}, r"seq_len \(15\) is not divisible by 2")):
        bad = _cfg("moe_debug", 2, tp=2)
        apply_overrides(bad, over)
        with pytest.raises(ConfigError, match=words):
            validate(bad, 2)
    assert cfg.parallel.expert_tp == 1
