"""The planner's trainer accounting (``planner.trainer_memory``) against what ndtrain's modules
really keep: one block's saved tensors measured by ``ActivationMeter`` (the difference between a
2-block and a 1-block model, so the embedding, head and loss cancel), the loss buffer of the
plain and the fused head, and the state table against ``planner.eager``'s measured one."""
from __future__ import annotations

import pytest
import torch

from ndtrain.config import load_config
from ndtrain.mem_account import ActivationMeter
from ndtrain.model import build_model
from ndtrain.planner.eager import eager_layer_bytes, estimate_trainer_state_bytes, param_shapes
from ndtrain.planner.layout import Layout, Workload
from ndtrain.planner.memory import estimate_memory
from ndtrain.planner.model_spec import from_model_config
from ndtrain.planner.trainer_memory import trainer_layer_bytes, trainer_loss_bytes, trainer_state_bytes

B, T = 2, 64


def _saved_after_forward(model_cfg) -> int:
    """Bytes alive after the forward of a (B, T) batch (what backward will read), float32."""
    torch.manual_seed(0)
    model = build_model(model_cfg, "cpu", torch.float32)
    x = torch.randint(0, model_cfg.vocab_size, (B, T))
    with ActivationMeter(model.parameters()) as meter:
        out = model(x)
        kept = meter.current
        del out
    return kept


def _one_block(preset: str, n: int = 1, **model) -> tuple[int, object]:
    """Measured bytes the last block keeps (n + 1 blocks minus n), and the model config."""
    cfgs = [load_config(preset, {**{f"model.{k}": v for k, v in model.items()}, "model.n_layers": k,
                                 "model.max_seq_len": T, "data.seq_len": T}).model for k in (n, n + 1)]
    return _saved_after_forward(cfgs[1]) - _saved_after_forward(cfgs[0]), cfgs[1]


def test_dense_block_matches_measured_saved_tensors_and_the_eager_model():
    """A dense GQA block in fp32: the measured bytes within 5%, and equal to ``planner.eager``'s
    tp = 1 derivation (which its own tests pin to real runs) within 1%."""
    measured, mcfg = _one_block("debug", dim=128, n_heads=4, n_kv_heads=2, ffn_hidden=256, vocab_size=256)
    spec = from_model_config(mcfg)
    planned = trainer_layer_bytes(spec, B * T, T, kind="lowp", e=4)["total"]
    eager = eager_layer_bytes(spec, "float32")
    eager_total = eager["per_token"] * B * T + eager["per_microbatch"] + eager["per_seq_pos"] * T
    assert planned == pytest.approx(measured, rel=0.05)
    assert planned == pytest.approx(eager_total, rel=0.01)


def test_moe_block_keeps_what_the_dispatch_holds():
    """A MoE block (8 experts, top-2): per routed copy the dispatched input, SwiGLU tensors and the
    weighted output; the planner within 10% of the measured block. The fused model's old rule
    (every copy's input, 6 bytes per hidden unit of each copy in bf16) is not what is kept."""
    measured, mcfg = _one_block("moe_debug", dim=128, n_heads=4, n_kv_heads=2, ffn_hidden=256,
                                moe_ffn_hidden=256, vocab_size=256)
    spec = from_model_config(mcfg)
    planned = trainer_layer_bytes(spec, B * T, T, moe=True, kind="lowp", e=4)["total"]
    dense = trainer_layer_bytes(spec, B * T, T, moe=False, kind="lowp", e=4)["total"]
    assert planned == pytest.approx(measured, rel=0.10)
    assert planned > dense  # two copies of a 256-wide expert keep more than one 256-wide MLP


def test_mla_block_keeps_latents_and_expanded_heads():
    """An MLA block (MoE with a shared expert, DeepSeek-V3's): q / kv latents and norms, then the
    full per-head q, k, v the core receives, and (query width 24 != value width 16: SDPA's math path
    on CPU) T x T scores; the planner within 10% of the measured block."""
    measured, mcfg = _one_block("deepseek_v3_debug", 2, dim=128, ffn_hidden=256, vocab_size=256, mtp_depth=0)
    spec = from_model_config(mcfg)
    planned = trainer_layer_bytes(spec, B * T, T, moe=True, kind="lowp", e=4)["total"]
    assert planned == pytest.approx(measured, rel=0.10)


def test_state_table_matches_the_measured_eager_state_model():
    """Bytes per parameter x parameters = ``planner.eager.estimate_trainer_state_bytes`` (pinned to
    ``mem_account`` in its own tests) within 1% for every ZeRO stage, fp32 and bf16; masters fp32."""
    spec = from_model_config(load_config("debug", {"model.dim": 256, "model.ffn_hidden": 512}).model)
    psi = sum(torch.Size(s).numel() for _, s in param_shapes(spec))
    for dtype, act in (("float32", 4), ("bfloat16", 2)):
        for z in (0, 1, 2, 3):
            ref = estimate_trainer_state_bytes(spec, z, 4, dtype, hooks_sampled=False)
            per = trainer_state_bytes("fp32", act, z, 4)
            for k, r in (("params", "params"), ("optimizer", "optim")):
                assert per[k] * psi == pytest.approx(ref[r], rel=0.01), (dtype, z, k)
    assert trainer_state_bytes("fp32", 2, 1, 8)["optimizer"] == 12 / 8  # fp32 master + Adam m, v


def test_loss_buffer_follows_the_fused_loss():
    """Plain head: 14 bytes a logit (vocab / tp); fused: blocks and the head's weight gradient only,
    so at 32K tokens x 128K vocabulary it falls from 55 GiB to under 3 GiB; the planner's fused
    model follows ``Workload.fused_loss`` too."""
    spec = from_model_config(load_config("llama3_8b").model)
    plain = trainer_loss_bytes(spec, 32768, 1)
    fused = trainer_loss_bytes(spec, 32768, 1, fused_loss=True)
    assert plain == 14 * 32768 * spec.vocab_size
    assert fused < 3 * 2**30 < 50 * 2**30 < plain  # the fp32 V x C weight gradient is most of it
    lay = Layout(tp=8, dp_shard=1, microbatch=1)
    for model in ("fused", "trainer"):
        mem = [estimate_memory(spec, Workload(seq_len=8192, global_batch_tokens=8192, memory_model=model,
                                              fused_loss=f), lay, 80e9).breakdown["logits"] for f in (False, True)]
        assert mem[1] < mem[0] / 4


def test_unknown_memory_model_is_named():
    spec = from_model_config(load_config("debug").model)
    with pytest.raises(ValueError, match="memory_model"):
        estimate_memory(spec, Workload(seq_len=32, global_batch_tokens=256, memory_model="x"), Layout(dp_shard=1), 1e9)


def test_zero3_gathers_only_the_ranks_own_experts():
    """Under ZeRO-3 a rank gathers one block at a time, and of a MoE block only its E / ep local
    experts (the experts' FSDP units shard over edp): the buffer counts the local block's
    parameters, measured on the real model's MoE block (its routed experts sit in ``experts``)."""
    cfg = load_config("moe_debug", {"model.n_layers": 2})
    model = build_model(cfg.model, "meta", torch.float32)
    blk = model.layers["1"]
    expert = sum(p.numel() for n, p in blk.named_parameters() if ".experts." in f".{n}")
    whole = sum(p.numel() for p in blk.parameters())
    spec = from_model_config(cfg.model)
    e = cfg.model.moe_experts
    for ep in (1, 2, e):
        lay = Layout(dp_shard=e, ep=ep, zero_stage=3)
        w = Workload(seq_len=64, global_batch_tokens=64 * e, precision="mixed", act_bytes=2, memory_model="trainer")
        buf = estimate_memory(spec, w, lay, 80e9).breakdown["zero3_buffers"]
        assert buf == pytest.approx((whole - expert + expert / ep) * (2 * 2 + 4)), ep


@pytest.mark.parametrize("memory_model", ["trainer", "fused"])
def test_the_folded_expert_mesh_splits_experts_by_expert_tp_and_shards_them_over_edp(memory_model):
    """Experts split and ZeRO-shard as the trainer's mesh (``mesh.py``) does, on 8 ranks: folded
    (expert_tp 2 under tp 4, ep 2: edp 2) a rank holds a quarter of the experts in 2 shards; whole
    experts (expert_tp 1 under tp 2, ep 4 within dp_shard 4) a quarter, the tp copies outside the
    shard group; the tied mesh (experts over the attention tp 4 x ep 2) an eighth, unsharded."""
    cfg = load_config("moe_debug", {"model.n_layers": 2})
    spec = from_model_config(cfg.model)
    w = Workload(seq_len=64, global_batch_tokens=64 * 8, precision="fp32", act_bytes=4, memory_model=memory_model)
    model = build_model(cfg.model, "meta", torch.float32)
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in f".{n}")
    dense = sum(p.numel() for p in model.parameters()) - expert
    gathered = {}
    for lay, share, shards in ((Layout(tp=4, dp_shard=2, ep=2, zero_stage=3, expert_tp=2), 1 / 4, 2),
                               (Layout(tp=2, dp_shard=4, ep=4, zero_stage=3, expert_tp=1), 1 / 4, 1),
                               (Layout(tp=4, dp_shard=2, ep=2, zero_stage=3), 1 / 8, 1)):
        assert lay.etp * lay.ep == round(1 / share) and lay.expert_shards == shards
        got = estimate_memory(spec, w, lay, 80e9).breakdown
        # ZeRO-3, fp32: 4 bytes a local parameter; dense over tp, then dp_shard shards
        want = dense / lay.tp * 4 / lay.dp_shard + expert * share * 4 / shards
        assert got["params"] == pytest.approx(want), lay  # exact: the same counts, split the same way
        gathered[lay.expert_tp] = got["zero3_buffers"]
    assert gathered[2] > gathered[-1]  # a folded rank gathers twice the expert bytes of a block
