"""A hybrid model holding every token mixer (linear, Mamba-2, Gated DeltaNet, sliding window, DSA,
softmax) under tensor parallel (tp=2, with and without sequence parallel) and pipeline parallel
(pp=2, 1F1B) on 2 gloo ranks, against the single-process run of the same global batches.

Reference: the world-size-1 ``Trainer`` (same seed, same batches), run once in each rank. Compared
per step: the loss, the gradient norm before clipping and every gradient the optimizer applies (TP
shards cut from the reference's whole gradient, block by block for the fused Mamba-2 / Gated
DeltaNet weights); at the end every parameter. Tolerance 1e-6 relative in float64 (the issue's
contract): the layouts only reorder sums (row-parallel all-reduces, the DSA head-sum all-reduce,
replicated gains' gradient all-reduces), about 1e-13 after 10 AdamW steps; a wrong head, block
or group split, a missing gradient reduction or a stage dropping a mixer's state gives O(1) errors.
The tp run also gathers the trained model to rank 0 (``rundir.gather_model``, the checkpoint / HF
export path) and round-trips its checkpoint state through ``gather_tp_state`` / ``scatter_tp_state``.
"""
from __future__ import annotations

import torch

from ndtrain.config import Config, ModelConfig, ParallelConfig, validate
from ndtrain.errors import ConfigError
from ndtrain.mesh import ParallelDims
from tests.dist_utils import run_ranks
from tests.parallel.layout_parity import _expected_local, _full_param, _record_grads, global_batch
from tests.utils import rel_err, tiny_config

STEPS = 10
MODEL = {"vocab_size": 61, "dim": 32, "n_layers": 6, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 48,
         "max_seq_len": 64, "layer_pattern": "LMGSDA", "linear_chunk_size": 4, "swa_window": 5, "dsa_top_k": 6,
         "dsa_index_heads": 2, "mamba_state_dim": 8, "mamba_head_dim": 8, "mamba_groups": 2, "linear_heads": 2,
         "linear_value_heads": 4}
LAYOUTS = ({"tp": 2}, {"tp": 2, "sequence_parallel": True}, {"pp": 2, "pp_schedule": "1f1b"})
# Qwen3-Next / Mamba-2 block shapes: softmax attention with QK-norm and the output gate, blocks
# without a feed-forward; under tp the gate is split by heads, the QK-norm gains' gradients summed
GATED = dict(MODEL, n_layers=2, layer_pattern="MA", block_ffn=False, qk_norm=True, attn_output_gate=True)


def _cfg(world: int, model: dict = MODEL, **par) -> Config:
    micro = 2 if par.get("pp", 1) > 1 else 0  # two microbatches through the pipeline
    return tiny_config({"model.rope_theta": 500000.0, "training.micro_batch_size": micro,
                        "parallel.bucket_size_bytes": 25 * 2**20}, world=world, model=model,
                       parallel={"dp_shard": -1, **par})


def _trainer(cfg: Config, world: int):
    from ndtrain.train.loop import Trainer

    mesh = ParallelDims.from_config(cfg.parallel, world).build_mesh()
    return Trainer(cfg, mesh, torch.device("cpu")), mesh


def _reference(model: dict = MODEL) -> dict:
    tr, _ = _trainer(_cfg(1, model), 1)
    grads: list = []
    _record_grads(tr, grads)
    steps = [tr.step(*global_batch(s)) for s in range(STEPS)]
    return {"steps": steps, "grads": grads,
            "params": {n: p.detach().clone() for n, p in tr.dp.model_state_dict().items()}}


def _gather_checks(tr, cfg: Config, mesh, ref: dict, rank: int) -> dict:
    """The trained tp model gathered whole on rank 0 (names, shapes, values) and the checkpoint
    state's gather / scatter round trip on every rank."""
    from ndtrain.parallel.tp.state import gather_tp_state, scatter_tp_state
    from ndtrain.train.rundir import gather_model

    local = {n: v.detach().clone() for n, v in tr.dp.model_state_dict().items()}
    back = scatter_tp_state(gather_tp_state({"model": dict(local)}, tr.model, mesh), tr.model, mesh)["model"]
    out = {"roundtrip": max(rel_err(back[n], v) for n, v in local.items())}
    model = gather_model(tr, cfg)
    if rank == 0:
        full = model.state_dict()
        assert full.keys() == ref["params"].keys()
        out["gathered"] = max(rel_err(full[n], p) for n, p in ref["params"].items())
        out["shapes_equal"] = all(full[n].shape == p.shape for n, p in ref["params"].items())
    return out


def _run(par: dict, world: int, rank: int, ref: dict, model: dict = MODEL) -> dict:
    cfg = _cfg(world, model, **par)
    tr, mesh = _trainer(cfg, world)
    tp = mesh.group("tp")
    grads: list = []
    _record_grads(tr, grads)
    out = {"par": par, "loss": 0.0, "grad_norm": 0.0, "grad": 0.0, "param": 0.0}
    for step in range(STEPS):
        d, r = tr.step(*global_batch(step)), ref["steps"][step]
        out["loss"] = max(out["loss"], abs(d["loss"] - r["loss"]) / abs(r["loss"]))
        out["grad_norm"] = max(out["grad_norm"], abs(d["grad_norm"] - r["grad_norm"]) / r["grad_norm"])
        for name, g in grads[step].items():
            out["grad"] = max(out["grad"], rel_err(g, _expected_local(tr, name, ref["grads"][step][name], tp)))
    state = tr.dp.model_state_dict()
    out["stage_share"] = len(state) / len(ref["params"])
    for name, value in state.items():
        out["param"] = max(out["param"], rel_err(_full_param(tr, name, value, tp), ref["params"][name]))
    out["split"] = sorted(n for n, p in tr.model.named_parameters() if hasattr(p, "ndtrain_tp_shard"))
    if par.get("tp", 1) > 1 and not par.get("sequence_parallel"):
        out.update(_gather_checks(tr, cfg, mesh, ref, rank))
    return out


def _rank(rank: int, world: int) -> list[dict]:
    torch.set_num_threads(1)
    ref = _reference()
    out = [_run(dict(par), world, rank, ref) for par in LAYOUTS]
    return out + [_run({"tp": 2, "sequence_parallel": True}, world, rank, _reference(GATED), GATED)]


def test_hybrid_mixers_tp2_sp_pp2_match_single_process():
    for per_rank in run_ranks(_rank, 2):
        for r in per_rank:
            for key in ("loss", "grad_norm", "grad", "param"):
                assert r[key] < 1e-6, (r["par"], key, r[key])
            if "roundtrip" in r:
                assert r["roundtrip"] == 0.0, r
            if "gathered" in r:
                assert r["shapes_equal"] and r["gathered"] < 1e-6, r
            if r["par"].get("tp") and len(r["split"]) < 20:  # GATED: the gate split, the QK-norm gains whole
                assert "layers.1.attention.wg.weight" in r["split"], r["split"]
                assert not any("q_norm" in n or "k_norm" in n for n in r["split"]), r["split"]
            elif r["par"].get("tp"):  # every mixer's head-split weights really are split
                for frag in ("0.attention.wq", "1.attention.in_proj", "1.attention.conv1d", "1.attention.D",
                             "2.attention.in_proj_qkvz", "2.attention.conv1d", "2.attention.A_log",
                             "3.attention.wk", "4.attention.wo", "1.attention.norm"):
                    assert any(frag in n for n in r["split"]), (frag, r["split"])
            else:  # pipeline: each rank holds only its stage's parameters
                assert 0.2 < r["stage_share"] < 0.8, r


def test_mixer_tp_rules_name_the_head_counts():
    """Head / group counts that do not split over tp are rejected with the numbers involved."""
    for over, words in (({"mamba_groups": 1}, "mamba_groups (1)"), ({"linear_heads": 1, "linear_value_heads": 2},
                                                                     "linear_heads 1")):
        cfg = Config(model=ModelConfig(**{**MODEL, **over}), parallel=ParallelConfig(tp=2))
        cfg.data.seq_len = 16
        try:
            validate(cfg, 2)
        except ConfigError as e:
            assert words in str(e), e
        else:
            raise AssertionError(f"{over} with tp=2 should be rejected")


def test_pipeline_balance_reads_the_mixer_kinds():
    """Stage costs count each layer's own mixer: a linear layer has no T term, a softmax layer 4 T C.
    "LLLAAA" splits 3 / 3 at T = 16 but 4 / 2 at T = 8192 (the softmax layers dominate; a cost that
    ignored the kinds would keep 3 / 3), and the planner's split (``planner.pipeline.rank_layers``)
    is the trainer's (``parallel/pp/stage.plan_stage``) at both lengths."""
    from ndtrain.parallel.pp.stage import layer_costs, plan_stage
    from ndtrain.planner.model_spec import from_model_config
    from ndtrain.planner.pipeline import rank_layers

    cfg = Config(model=ModelConfig(**{**MODEL, "layer_pattern": "LLLAAA", "max_seq_len": 8192}),
                 parallel=ParallelConfig(pp=2))
    short, long = layer_costs(cfg.model, 16)[1], layer_costs(cfg.model, 8192)[1]
    assert short[0] == long[0] and long[3] - short[3] == 4.0 * (8192 - 16) * 32  # linear: no T; softmax: 4 T C
    spec = from_model_config(cfg.model)
    for seq, want in ((16, [[0, 1, 2], [3, 4, 5]]), (8192, [[0, 1, 2, 3], [4, 5]])):
        cfg.data.seq_len = seq
        trainer = [[int(i) for c in plan_stage(cfg, r).chunks for i in c] for r in range(2)]
        planner = [list(r["layers"]) for r in rank_layers(spec, 2, 1, "1f1b", seq)]
        assert trainer == planner == want, (seq, trainer, planner)
