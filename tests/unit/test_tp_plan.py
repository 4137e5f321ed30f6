"""The one tensor-parallel plan table (``ndtrain.parallel.tp.plan.TP_PLAN``): ``print(model)`` after
tp2 shows every layer's sharding (dense, MoE with and without expert parallel, MLA + MTP, every
token mixer), names never change, every row of the table is used by some model, and a module two
rows match is refused. No process group (``FakeMesh``): installing the modules communicates nothing.
"""
from __future__ import annotations

import pytest
import torch

from ndtrain.config import load_config
from ndtrain.model import build_model
from ndtrain.parallel.tp import plan as tp_plan
from ndtrain.parallel.tp.styles import TPContext
from ndtrain.parallel.tp.tensor_parallel import apply_tp
from tests.parallel.test_tp import FakeMesh

SMALL = {"model.vocab_size": 61, "model.dim": 32, "model.n_heads": 4, "model.n_kv_heads": 2,
         "model.ffn_hidden": 48, "model.max_seq_len": 64}
MOE = {**SMALL, "model.moe_ffn_hidden": 16, "model.moe_shared_experts": 1, "model.moe_shared_gate": True}
MIXERS = {**SMALL, "model.layer_pattern": "MGSDLA", "model.n_layers": 6, "model.mamba_groups": 2,
          "model.mamba_head_dim": 8, "model.mamba_state_dim": 8, "model.linear_heads": 2, "model.linear_value_heads": 4,
          "model.linear_key_head_dim": 8, "model.linear_value_head_dim": 8, "model.swa_window": 4,
          "model.dsa_top_k": 4, "model.dsa_index_heads": 2, "model.moe_experts": 0}
GATED = {**SMALL, "model.qk_norm": True, "model.attn_output_gate": True}
MODELS = {"dense": ("debug", SMALL), "moe": ("moe_debug", MOE), "mla": ("deepseek_v3_debug", {}),
          "mla_full_q": ("deepseek_v3_debug", {"model.mla_q_rank": 0}),
          "mixers": ("hybrid_debug", MIXERS), "gated": ("debug", GATED)}


def _tp2(name: str, rank: int = 1, sp: bool = False, expert_tp: int = 1, ep: int = 1):
    preset, over = MODELS[name]
    cfg = load_config(preset, over)
    model = build_model(cfg.model, "cpu", torch.float64, 0)
    keys = list(model.state_dict())
    if ep > 1:
        from ndtrain.parallel.ep.expert_parallel import apply_ep

        apply_ep(model, FakeMesh(rank, ep=ep), cfg)
    apply_tp(model, FakeMesh(rank, tp=2, ep=ep), sequence_parallel=sp, expert_tp=expert_tp)
    assert list(model.state_dict()) == keys  # names never change
    return model


def _assert_lines(model, lines) -> None:
    text = repr(model)
    for line in lines:
        assert line in text, (line, text)


def test_print_shows_dense_sharding():
    _assert_lines(_tp2("dense", sp=True), (
        "(tok_embeddings): VocabParallelEmbedding(rows=62/tp2 [31, 62), vocab=61, dim=32, sp=True)",
        "(attention_norm): SequenceParallelNorm(RMSNorm(32, eps=1e-05), weight grad: all-reduce over tp2)",
        "(wq): ColumnParallelLinear(in=32, out=32/tp2, sp=True)",
        "(wo): RowParallelLinear(in=32/tp2, out=32, sp=True, output: reduce-scatter T)",
        "(w2): RowParallelLinear(in=48/tp2, out=32, sp=True, output: reduce-scatter T)",
        "(output): ColumnParallelLinear(in=32, out=62/tp2 (padded from 61), sp=True, input: all-gather T)"))


def test_print_shows_moe_sharding():
    moe = "(feed_forward): TensorParallelMoE(\n        tp=2, tokens: split T on entry, all-gather on exit, load statistics summed over tp"
    _assert_lines(_tp2("moe", expert_tp=2), (
        moe,
        "(router): ReplicatedLinear(in=32, out=8 (whole), fp32, weight grad: all-reduce over tp2)",
        "(experts): SplitExpertsTP(experts 8, hidden=16/tp2, dim=32, rows: all-gather / reduce-scatter over tp)",
        "(w2): RowParallelLinear(in=16/tp2, out=32, sp=True, output: reduce-scatter T)",  # shared expert: token rows
        "(tp_input): RegionInput(tp=2, all-gather T)",
        "(shared_gate): ReplicatedLinear(in=32, out=1 (whole), weight grad: all-reduce over tp2)"))
    whole = ("(experts): WholeExpertsTP(experts [4, 8) of 8 on ep2 rank 1 (ep dispatch / combine: all-to-all), "
             "hidden=16, dim=32, whole on tp2, weight grad: all-reduce over tp)")
    _assert_lines(_tp2("moe", expert_tp=1, ep=2), (whole,))


def test_print_shows_mla_and_mtp_sharding():
    model = _tp2("mla", sp=True)
    _assert_lines(model, (
        "(wq_a): ReplicatedLinear(in=64, out=32 (whole), weight grad: all-reduce over tp2)",
        "(q_norm): SequenceParallelNorm(RMSNorm(32, eps=1e-06), weight grad: all-reduce over tp2)",
        "(wq_b): ColumnParallelLinear(in=32, out=96/tp2, sp=True)",
        "(wkv_b): ColumnParallelLinear(in=16, out=128/tp2, sp=True)",
        "(wo): RowParallelLinear(in=64/tp2, out=64, sp=True, output: reduce-scatter T)",
        "(tp_input): RegionInput(tp=2, all-gather T)",
        "(proj): ReplicatedLinear(in=128, out=64 (whole), weight grad: all-reduce over tp2)",
        "(hnorm): SequenceParallelNorm(RMSNorm(64, eps=1e-05), weight grad: all-reduce over tp2)"))
    assert type(model.mtp["0"].block.attention.wq_b).__name__ == "ColumnParallelLinear"  # MTP block = {block}
    assert type(_tp2("mla_full_q").layers["0"].attention.wq).__name__ == "ColumnParallelLinear"  # no q latent


def test_print_shows_every_mixer_sharding():
    model = _tp2("mixers")
    _assert_lines(model, (
        "(in_proj): ColumnParallelLinear(in=32, out=",  # Mamba-2 [z | x | B | C | dt]
        "(conv1d): BlockParallelConv1d(channels=96/tp2 in blocks [64, 16, 16], kernel=4, depthwise)",
        "(tp_input): RegionInput(tp=2, copy (bwd all-reduce), split by head: dt_bias, A_log, D)",
        "(in_proj_qkvz): ColumnParallelLinear(in=32, out=96/tp2, sp=False)",
        "(conv1d): BlockParallelConv1d(channels=64/tp2 in blocks [16, 16, 32], kernel=4, depthwise)",
        "(norm): SequenceParallelNorm(GatedRMSNorm(8, eps=1e-06), weight grad: all-reduce over tp2)",
        "(tp_input): RegionInput(tp=2, copy (bwd all-reduce), split by head: dt_bias, A_log)",
        "(out_proj): RowParallelLinear(in=32/tp2, out=32, sp=False, output: all-reduce)"))
    kinds = [type(b.attention).__name__ for b in model.layers.values()]
    assert kinds == ["Mamba2", "GatedDeltaNet", "SlidingWindowAttention", "SparseAttention", "LinearAttention",
                     "Attention"]
    for i in ("2", "3", "4", "5"):  # softmax family and linear attention: heads split, wo row-parallel
        att = model.layers[i].attention
        assert type(att.wq).__name__ == "ColumnParallelLinear" and type(att.wo).__name__ == "RowParallelLinear"
    assert type(model.layers["3"].attention.wq_index).__name__ == "Linear"  # DSA indexer replicated
    # per-rank counts the mixers read: Mamba-2 8 heads (d_inner 64 / head dim 8), Gated DeltaNet 4 value heads
    assert model.layers["0"].attention.n_heads == 4 and model.layers["1"].attention.num_v_heads == 2


def test_every_row_is_used_and_kinds_are_exact():
    """Each pattern of the table matches a module in one of these models (no dead rows); the
    ``[kind]`` guards keep Mamba-2's and Gated DeltaNet's same-named children apart."""
    used = set()
    for preset, over in MODELS.values():
        model = build_model(load_config(preset, over).model, "cpu", torch.float64, 0)
        for pattern in tp_plan.TP_PLAN:
            rx, guards = tp_plan._compile(pattern)
            mods = dict(model.named_modules())
            for n in mods:
                m = rx.match(n)
                if m and all(type(mods[m.group(g)]) in tp_plan.KINDS[k] for g, k in guards):
                    used.add(pattern)
    assert sorted(set(tp_plan.TP_PLAN) - used) == []


def test_a_module_two_rows_match_is_refused():
    model = build_model(load_config("debug", SMALL).model, "cpu", torch.float64, 0)
    ctx = TPContext(FakeMesh(0, tp=2).group("tp"), False, None, 61)
    plan = {"layers.*.attention[attention].wq": tp_plan.TP_PLAN["{block}.attention[softmax].wq"],
            "{block}.attention.wq": tp_plan.TP_PLAN["{block}.attention[softmax].wq"]}
    with pytest.raises(ValueError, match="module layers.0.attention.wq matches more than one"):
        tp_plan.apply_plan(model, plan, ctx)
    with pytest.raises(ValueError, match="unknown kind 'mamba'"):
        tp_plan._compile("{block}.attention[mamba].in_proj")
