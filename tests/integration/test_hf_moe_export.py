"""Export to Hugging Face Mixtral / DeepSeek-V3 (``ndtrain.hf.moe`` via ``save_hf_checkpoint``).

Round trip: a tiny transformers model (random weights, initializer_range 0.2 so logits are O(5) and
routing is far from uniform) is saved, imported, exported, and the export is loaded with
``AutoModelForCausalLM.from_pretrained``: its logits must equal the original's and ndtrain's to
1e-5 in float32 (same float32 operations on both sides, only matmul summation order differs; a
wrong expert, a RoPE row permutation error or a lost selection bias changes logits by O(1)), and
every exported tensor must equal the original checkpoint's exactly (so DeepSeek's re-interleaved
RoPE rows are the inverse of the import permutation, not merely an equivalent layout).
"""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
)

from ndtrain.hf.common import read_safetensors
from ndtrain.hf.folder import load_hf_checkpoint, save_hf_checkpoint
from ndtrain.hf.moe import config_from_hf_moe, config_to_hf_moe, state_dict_to_hf_moe
from ndtrain.model import build_model


def tokens():
    return torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))


def mixtral(tie: bool) -> MixtralForCausalLM:
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        rope_theta=5e4, rms_norm_eps=1e-6, tie_word_embeddings=tie, initializer_range=0.2)).eval()


def deepseek(q_lora: int | None) -> DeepseekV3ForCausalLM:
    hf = DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=2,
        num_experts_per_tok=3, n_group=4, topk_group=2, first_k_dense_replace=1, q_lora_rank=q_lora,
        kv_lora_rank=12, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10, routed_scaling_factor=2.5,
        norm_topk_prob=q_lora is None, max_position_embeddings=64, initializer_range=0.2)).eval()
    with torch.no_grad():
        for i in (1, 2):
            hf.model.layers[i].mlp.gate.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, 8))
    return hf


CASES = [("mixtral", False), ("mixtral", True), ("deepseek_v3", 16), ("deepseek_v3", None)]


@pytest.mark.parametrize("family,arg", CASES)
@torch.no_grad()
def test_round_trip_through_transformers(tmp_path, family, arg):
    torch.manual_seed(3)
    hf = mixtral(arg) if family == "mixtral" else deepseek(arg)
    hf.save_pretrained(tmp_path / "orig")
    cfg, model = load_hf_checkpoint(tmp_path / "orig")
    save_hf_checkpoint(model, cfg, tmp_path / "export")
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["model_type"] == family
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert type(back) is type(hf) and back.config.tie_word_embeddings == hf.config.tie_word_embeddings
    ref = hf(tokens()).logits
    assert ref.abs().max() > 1.0
    torch.testing.assert_close(back(tokens()).logits, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(model.eval()(tokens()), ref, atol=1e-5, rtol=0)
    orig, new = read_safetensors(tmp_path / "orig"), read_safetensors(tmp_path / "export")
    assert orig.keys() == new.keys()
    assert all(torch.equal(orig[k], new[k]) for k in orig)


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
@torch.no_grad()
def test_export_native_model(tmp_path, family):
    """A model built by ndtrain (not imported) exports to logits transformers reproduces."""
    hf_cfg = (mixtral(False) if family == "mixtral" else deepseek(16)).config.to_dict()
    cfg = config_from_hf_moe(hf_cfg)
    cfg.init_std = 0.2
    model = build_model(cfg, seed=4).eval()
    if family == "deepseek_v3":
        model.layers["1"].feed_forward.expert_bias.copy_(torch.linspace(0.2, -0.2, 8))
    save_hf_checkpoint(model, cfg, tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ref = model(tokens())
    assert ref.abs().max() > 1.0
    torch.testing.assert_close(back(tokens()).logits, ref, atol=1e-5, rtol=0)
    assert config_from_hf_moe(json.loads((tmp_path / "config.json").read_text())) == cfg


def test_unexportable_configs_rejected():
    cfg = config_from_hf_moe(mixtral(False).config.to_dict())
    for bad in ({"moe_score": "sigmoid"}, {"moe_shared_experts": 1}, {"moe_layer_interleave": 2},
                {"moe_route_scale": 2.0}, {"rope_scaling": True}):
        with pytest.raises(ValueError):
            config_to_hf_moe(type(cfg)(**{**cfg.__dict__, **bad}))
    ds = config_from_hf_moe(deepseek(16).config.to_dict())
    for bad in ({"moe_score": "softmax"}, {"moe_shared_experts": 0}):
        with pytest.raises(ValueError):
            config_to_hf_moe(type(ds)(**{**ds.__dict__, **bad}))
    model = build_model(cfg, seed=0)
    model.layers["0"].feed_forward.expert_bias.fill_(0.1)  # Mixtral has no selection bias
    with pytest.raises(ValueError, match="expert_bias"):
        state_dict_to_hf_moe(model.state_dict(), cfg)
