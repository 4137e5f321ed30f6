"""Hardware table, model specs (presets and Hugging Face configs, dense and MoE), layout strings."""
import json

import pytest

from ndtrain.config import load_config
from ndtrain.planner.hardware import HARDWARE, Cluster, get_accelerator
from ndtrain.planner.layout import Layout, Workload, check_layout, parse_layout
from ndtrain.planner.model_spec import from_hf_config, load_model_spec
from ndtrain.train.metrics import flops_per_token
from tests.flops_reference import config_flops_per_token


def test_hardware_table():
    for name in ("H100", "H200", "A100-40GB", "A100-80GB", "B200", "MI300X", "cpu"):
        acc = get_accelerator(name)
        assert acc.peak("bf16") > 0 and acc.peak("fp32") > 0 and acc.hbm_bytes > 0
        assert acc.intra_node_bytes_per_s > acc.inter_node_bytes_per_s > 0
    h100 = get_accelerator("h100")
    assert h100.peak("bfloat16") == pytest.approx(989.4e12)
    assert h100.peak("fp8") == pytest.approx(2 * 989.4e12, rel=0.01)
    assert h100.intra_node_bytes_per_s == pytest.approx(450e9)  # 900 GB/s NVLink, per direction
    assert h100.inter_node_bytes_per_s == pytest.approx(50e9)  # 400 Gb/s NDR
    assert get_accelerator("A100").hbm_bytes > get_accelerator("A100-40GB").hbm_bytes
    with pytest.raises(ValueError, match="known"):
        get_accelerator("TPUv9")
    with pytest.raises(KeyError):
        get_accelerator("A100-80GB").peak("fp8")
    assert len(HARDWARE) >= 7


def test_cluster_links():
    c = Cluster(get_accelerator("H100"), 1024, pod_gpus=256, inter_pod_bytes_per_s=10e9)
    assert c.nodes == 128
    assert c.link(8)[0] == "intra-node" and c.link(16)[0] == "inter-node"
    assert c.link(512) == ("inter-pod", 10e9, pytest.approx(20e-6))
    with pytest.raises(ValueError):
        Cluster(get_accelerator("H100"), 0)


@pytest.mark.parametrize("preset,billions",
                         [("llama3_8b", 8.03), ("llama3_70b", 70.55), ("llama3_405b", 405.85)])
def test_llama3_parameter_counts(preset, billions):
    spec, seq = load_model_spec(preset)
    assert seq == 8192
    assert spec.params_total / 1e9 == pytest.approx(billions, rel=0.002)
    assert spec.params_active == spec.params_total
    # the trainer's MFU reads the planner's count, which equals the one written from the config fields
    cfg = load_config(preset)
    assert flops_per_token(cfg.model, 8192) == spec.flops_per_token(8192)
    assert spec.flops_per_token(8192) == pytest.approx(config_flops_per_token(cfg.model, 8192))


def test_flops_per_token_convention():
    spec, _ = load_model_spec("llama3_8b")
    n = spec.params_total - spec.embedding_params  # head counted, input embedding not
    assert spec.params_nonembed_active == n
    assert spec.flops_per_token(4096) == pytest.approx(6 * n + 12 * 32 * 32 * 128 * 4096)


def test_tied_embeddings_count_head_matmul():
    spec, _ = load_model_spec("default")
    assert spec.tie_embeddings
    assert spec.params_nonembed_active == spec.params_total  # the tied table counts once, as the head
    assert spec.flops_per_token(256) == pytest.approx(config_flops_per_token(load_config("default").model, 256))


def test_hf_dense_and_missing_fields(tmp_path):
    spec = from_hf_config({})  # everything missing: Llama-7B-like defaults
    assert spec.dim == 4096 and spec.n_layers == 32 and not spec.is_moe
    cfg = {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 128256,
           "tie_word_embeddings": True, "max_position_embeddings": 131072}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    spec, seq = load_model_spec(str(tmp_path))
    assert spec.params_total / 1e9 == pytest.approx(1.236, rel=0.01)  # Llama 3.2 1B
    assert seq == 4096
    with pytest.raises(ValueError):
        load_model_spec("no_such_preset")


def test_mixtral_moe():
    spec = from_hf_config({"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                           "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000,
                           "num_local_experts": 8, "num_experts_per_tok": 2})
    assert spec.is_moe and spec.n_moe_layers == 32
    assert spec.params_total / 1e9 == pytest.approx(46.7, rel=0.01)
    assert spec.params_active / 1e9 == pytest.approx(12.9, rel=0.01)


def test_deepseek_v3_moe_mla():
    spec = from_hf_config({
        "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "first_k_dense_replace": 3, "moe_layer_freq": 1, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280})
    assert spec.n_moe_layers == 58 and spec.n_dense_layers == 3
    assert spec.params_total / 1e9 == pytest.approx(671, rel=0.01)
    assert spec.params_active / 1e9 == pytest.approx(37.5, rel=0.03)


def test_qwen_moe_shared_expert():
    spec = from_hf_config({"hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 16,
                           "num_key_value_heads": 16, "intermediate_size": 5632, "num_experts": 60,
                           "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                           "shared_expert_intermediate_size": 5632, "vocab_size": 151936})
    assert spec.n_shared_experts == 1 and spec.shared_ffn_hidden == 5632
    assert spec.params_total / 1e9 == pytest.approx(14.3, rel=0.02)  # Qwen1.5-MoE-A2.7B
    assert spec.params_active / 1e9 == pytest.approx(2.7, rel=0.1)


def test_parse_layout_defaults_and_errors():
    lay = parse_layout("tp=8,cp=1,pp=16,dp_shard=64,zero_stage=3,ac=none,microbatch=1")
    assert (lay.tp, lay.pp, lay.dp_shard, lay.dp_replicate, lay.zero_stage) == (8, 16, 64, 1, 3)
    assert lay.pp_schedule == "1f1b" and lay.pp_virtual_stages == 1 and lay.seq_parallel
    assert parse_layout(str(lay)) == lay
    assert parse_layout("tp=2").resolve(16).dp_shard == 8
    with pytest.raises(ValueError, match="unknown layout key"):
        parse_layout("tensor=8")
    with pytest.raises(ValueError, match="integer"):
        parse_layout("tp=eight")
    with pytest.raises(ValueError, match="divisible"):
        parse_layout("tp=3").resolve(16)


def test_check_layout_rules():
    spec, _ = load_model_spec("llama3_8b")
    w = Workload(seq_len=8192, global_batch_tokens=512 * 8192)
    assert check_layout(spec, 64, w, Layout(tp=8, pp=2, dp_shard=4)) == []
    errs = check_layout(spec, 64, w, Layout(tp=8, pp=2, dp_shard=8))
    assert any("!= gpus" in e for e in errs)
    assert any("n_heads" in e for e in check_layout(spec, 48, w, Layout(tp=6, dp_shard=8)))
    # the rule texts are the config validation's (ndtrain/parallel/<axis>/rules.py)
    assert any("micro_batch_size (3)" in e for e in check_layout(spec, 64, w, Layout(dp_shard=64, microbatch=3)))
    assert any("interleaved" in e
               for e in check_layout(spec, 8, w, Layout(pp=2, dp_shard=4, pp_virtual_stages=2)))
    assert any("ep" in e for e in check_layout(spec, 8, w, Layout(dp_shard=8, ep=2)))
