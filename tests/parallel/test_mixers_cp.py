"""Context parallel of the linear-family mixers (state passing) and sliding-window attention
(neighbour exchange), alone and inside a hybrid model whose softmax layers run ring attention.

One spawn of 4 gloo ranks runs everything:

* unit level, cp = 4 and cp = 2 (x dp 2): each mixer (linear attention, Mamba-2, Gated DeltaNet,
  sliding window) forward + backward on its contiguous shard against the same module on the whole
  sequence in the same process: outputs, input gradients and parameter gradients (summed over cp);
* trainer level: the ``hybrid_debug`` preset shrunk (Gated DeltaNet 3:1 softmax attention, MoE with
  a shared expert, global-scope Switch loss), 10 float64 AdamW steps with clipping active, under
  cp = 2 x dp 2 and cp = 4, against the single-process ``Trainer`` on the same global batch; plus a
  pattern with every state-passing mixer (L M G S A) under cp = 4 with full activation checkpointing.

Tolerance 1e-6 relative (the issue's float64 contract). State passing is exact algebra (the local
chunk run from zero plus a composed initial state is the same sum as the whole-sequence run, in
another order), so the measured differences stay near 1e-13.
"""
from __future__ import annotations

import pytest
import torch

from ndtrain.config import ConfigError, apply_overrides, validate
from ndtrain.mesh import ParallelDims
from ndtrain.train.loop import IGNORE_INDEX, Trainer
from tests.dist_utils import run_ranks
from tests.utils import tiny_config

V, T, G, STEPS = 61, 16, 4, 10


def _model_cfg(pattern: str):
    return tiny_config({"model.layer_pattern": pattern, "model.n_layers": len(pattern), "model.linear_chunk_size": 3,
                        "model.linear_heads": 2, "model.linear_key_head_dim": 8, "model.linear_value_heads": 4,
                        "model.linear_value_head_dim": 8, "model.moe_ffn_hidden": 32, "model.moe_aux_scope": "global",
                        "model.swa_window": 3, "model.mamba_state_dim": 8, "model.mamba_head_dim": 8},
                       preset="hybrid_debug")


def _cfg(world: int, pattern: str = "GGGA", **par):
    cfg = _model_cfg(pattern)
    cfg.training.activation_checkpoint = par.pop("ac", "none")
    for k, v in {"dp_shard": -1, **par}.items():
        setattr(cfg.parallel, k, v)
    validate(cfg, world)
    return cfg


def _batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    seq = torch.randint(0, V, (G, T + 1), generator=g)
    labels = seq[:, 1:].clone()
    labels[torch.rand(G, T, generator=g) < 0.3] = IGNORE_INDEX
    return seq[:, :-1], labels


def _train(cfg, world: int, rank: int):
    mesh = ParallelDims.from_config(cfg.parallel, world).build_mesh()
    tr = Trainer(cfg, mesh, torch.device("cpu"))
    dp = mesh.group("dp")
    local = G // dp.size
    sl = slice(dp.rank * local, (dp.rank + 1) * local)
    steps, cp_bytes = [], []
    for s in range(STEPS):
        mesh.reset_stats()
        steps.append(tr.step(*(x[sl] for x in _batch(s))))
        cp_bytes.append(mesh.reset_stats().get("cp", 0.0))
    params = {}
    for name, value in tr.dp.model_state_dict().items():
        params[name] = value.full_tensor() if hasattr(value, "full_tensor") else value.detach().clone()
    return steps, params, cp_bytes, repr(tr.model)


def _parity(rank: int, world: int, pattern: str, **par) -> dict:
    ref_steps, ref_params, _, _ = _train(_cfg(1, pattern), 1, 0)
    steps, params, cp_bytes, text = _train(_cfg(world, pattern, **par), world, rank)
    rel = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(steps, ref_steps))
    gn = max(abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"] for a, b in zip(steps, ref_steps))
    prm = max(((params[n] - p).abs().max() / p.abs().max().clamp(min=1e-30)).item() for n, p in ref_params.items())
    return {"loss": rel, "grad_norm": gn, "param": prm, "ref_gn": ref_steps[0]["grad_norm"],
            "cp_bytes": cp_bytes[-1], "repr": text}


def _rank(rank: int, world: int) -> dict:
    from tests.parallel.mixer_cp_units import unit_checks

    out = {"units": unit_checks(rank, world)}
    out["cp2_dp2"] = _parity(rank, world, "GGGA", cp=2)
    out["cp4"] = _parity(rank, world, "GGGA", cp=4)
    out["all_cp4_ac"] = _parity(rank, world, "LMGSA", cp=4, ac="full")
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_rank, 4)


def test_each_mixer_cp_forward_backward_equals_whole_sequence(results):
    for per_rank in results:
        for name, (err, sent, theory) in per_rank["units"].items():
            assert err < 1e-10, (name, err)
            assert sent == theory, (name, sent, theory)


@pytest.mark.parametrize("layout", ["cp2_dp2", "cp4", "all_cp4_ac"])
def test_hybrid_under_cp_matches_single_process(results, layout):
    for per_rank in results:
        r = per_rank[layout]
        for key in ("loss", "grad_norm", "param"):
            assert r[key] < 1e-6, (layout, key, r[key])
        assert r["ref_gn"] > 0.05, "clipping should be active"
        assert "StatePasser(cp=" in r["repr"] and "RingAttention(cp=" in r["repr"], r["repr"]
        assert r["cp_bytes"] > 0


def test_rules_for_mixers_under_cp():
    cfg = _model_cfg("GGGA")
    apply_overrides(cfg, {"parallel.cp": 2, "parallel.cp_layout": "load_balanced"})
    with pytest.raises(ConfigError, match="needs parallel.cp_layout contiguous"):
        validate(cfg)
    cfg = _model_cfg("SA")
    apply_overrides(cfg, {"parallel.cp": 4, "data.seq_len": 8, "model.swa_window": 4})
    with pytest.raises(ConfigError, match=r"a rank's 2 tokens \(seq_len / cp\) are fewer than the 3"):
        validate(cfg)
    cfg = _model_cfg("DA")
    apply_overrides(cfg, {"parallel.cp": 2, "model.dsa_top_k": 4})
    with pytest.raises(ConfigError, match="dsa needs cp == 1"):
        validate(cfg)
    cfg = _model_cfg("GGGA")
    apply_overrides(cfg, {"parallel.cp": 2})
    validate(cfg)  # auto -> contiguous
    from ndtrain.parallel.cp.rules import resolve_layout

    assert resolve_layout("ring", "auto", ("gated_deltanet",)) == "contiguous"
    assert resolve_layout("ring", "auto", ("dsa",)) == "load_balanced"


@pytest.mark.parametrize("layout,cp", [("cp2_dp2", 2), ("cp4", 4)])
def test_planner_cp_bytes_equal_the_counted_traffic(results, layout, cp):
    """The planner's bytes per mixer (``planner.mixer_comm``: ring blocks and dK / dV for the softmax
    layer, state all-gathers and conv halos for the Gated DeltaNet ones) summed over the model's
    layers equal what each rank's counted primitives sent on cp in a training step, at every cp
    position (the first rank sends no backward halo, the last no forward one)."""
    from ndtrain.mixer_spec import layer_mixers
    from ndtrain.planner.mixer_comm import cp_layer_bytes
    from ndtrain.planner.model_spec import from_model_config

    cfg = _cfg(4, "GGGA", cp=cp)
    spec = from_model_config(cfg.model)
    seqs = G // (4 // cp)  # this rank's sequences per step, over all its microbatches
    kinds = layer_mixers(cfg.model.layer_pattern, cfg.model.n_layers)
    for rank, per_rank in enumerate(results):
        r = rank % cp
        pos = "first" if r == 0 else ("last" if r == cp - 1 else "middle")
        want = sum(sum(cp_layer_bytes(spec, k, seqs, T, cp, 1, 8, "ring", pos)) for k in kinds)
        assert per_rank[layout]["cp_bytes"] == want, (layout, rank, per_rank[layout]["cp_bytes"], want)
