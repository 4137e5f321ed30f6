"""Parity with Hugging Face Mixtral and DeepSeek-V3 (transformers, tiny models built locally).

Reference: transformers' ``MixtralForCausalLM`` / ``DeepseekV3ForCausalLM``, float32, eager CPU,
random weights (initializer_range 0.2 so logits are O(5) and routing is far from uniform).
Tolerance atol 1e-5: both sides do the same float32 operations (fp32 router, top-k, renormalised
or scaled weights, SwiGLU experts, RMSNorm, rotate-half RoPE -- DeepSeek's interleaved RoPE rows
are permuted on import, which is exact); only matmul summation order differs. A wrong routing
choice, a missing e_score_correction_bias, a wrong group mask or a RoPE pairing error changes
logits by O(1), so 1e-5 pins them.

DeepSeek-V3's ``e_score_correction_bias`` is set to a non-zero vector before saving, so the
biased selection (and the bias not entering the weights) is part of what is compared.

Omitted fields: a config.json with every key equal to its family's class default deleted (rope
theta, RMSNorm eps, DeepSeek's routing constants ...) must import to the same logits, to 1e-5 --
Llama's values (theta 1e4, eps 1e-6) would be off by O(1) for Mixtral.
"""
from __future__ import annotations

import json
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    LlamaConfig,
    MixtralConfig,
    MixtralForCausalLM,
)

from ndtrain.hf.folder import load_hf_checkpoint
from ndtrain.hf.llama import config_from_hf
from ndtrain.hf.moe import config_from_hf_moe
from ndtrain.model.moe import moe_layers


def tokens():
    return torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def test_mixtral_logits_match(tmp_path):
    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                        num_experts_per_tok=2, max_position_embeddings=64, initializer_range=0.2)
    hf = MixtralForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    ncfg, model = load_hf_checkpoint(tmp_path)
    assert ncfg.moe_experts == 4 and ncfg.moe_top_k == 2 and ncfg.moe_score == "softmax"
    assert len(moe_layers(model)) == 2
    model.eval()
    ref = hf(tokens()).logits
    assert ref.abs().max() > 1.0
    torch.testing.assert_close(model(tokens()), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("q_lora", [16, None])
@torch.no_grad()
def test_deepseek_v3_logits_match(tmp_path, q_lora):
    torch.manual_seed(1)
    cfg = DeepseekV3Config(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
                           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                           n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3, n_group=4,
                           topk_group=2, first_k_dense_replace=1, q_lora_rank=q_lora, kv_lora_rank=12,
                           qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10, routed_scaling_factor=2.5,
                           max_position_embeddings=64, initializer_range=0.2)
    hf = DeepseekV3ForCausalLM(cfg).eval()
    for i in (1, 2):  # a non-zero selection bias: changes which experts are chosen, not the weights
        hf.model.layers[i].mlp.gate.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, 8))
    hf.save_pretrained(tmp_path)
    ncfg, model = load_hf_checkpoint(tmp_path)
    assert ncfg.attention == "mla" and ncfg.moe_layer_start == 1 and ncfg.moe_n_groups == 4
    assert [type(b.feed_forward).__name__ for b in model.layers.values()] == ["FeedForward", "MoE", "MoE"]
    assert torch.equal(moe_layers(model)[0].expert_bias, torch.linspace(-0.3, 0.3, 8))
    model.eval()
    ref = hf(tokens()).logits
    assert ref.abs().max() > 1.0
    torch.testing.assert_close(model(tokens()), ref, atol=1e-5, rtol=0)
    # cached generation path (latent KV cache) reproduces the full forward
    from ndtrain.inference.generate import generate

    prompt = tokens()[0, :5]
    assert torch.equal(generate(model, prompt, 6), generate(model, prompt, 6, use_cache=False))


def test_unsupported_moe_configs_rejected():
    base = MixtralConfig(vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=4).to_dict()
    for bad in ({"sliding_window": 16}, {"hidden_act": "gelu"}, {"model_type": "qwen2_moe"},
                {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}):
        with pytest.raises(ValueError):
            config_from_hf_moe({**base, **bad})


# --- fields a config.json omits take the family's transformers defaults (never Llama's) ---

def _strip_defaults(folder, config_cls) -> list[str]:
    """Delete from ``folder``/config.json every key whose value equals ``config_cls()``'s default."""
    path = folder / "config.json"
    hf, defaults = json.loads(path.read_text()), config_cls().to_dict()
    gone = [k for k, v in hf.items() if k not in ("model_type", "architectures") and k in defaults
            and defaults[k] == v]
    path.write_text(json.dumps({k: v for k, v in hf.items() if k not in gone}))
    return gone


def _mixtral_defaults_model():
    # rope_theta (1e6) and rms_norm_eps (1e-5) left at MixtralConfig's defaults, unlike Llama's
    return MixtralForCausalLM(MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            num_local_experts=4, max_position_embeddings=64,
                                            initializer_range=0.2)).eval()


def _deepseek_defaults_model():
    # left at DeepseekV3Config's defaults: rope_theta, rms_norm_eps, routed_scaling_factor, n_group (8),
    # topk_group (4), first_k_dense_replace (3), n_shared_experts, norm_topk_prob, rope_interleave
    hf = DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16, num_experts_per_tok=3,
        q_lora_rank=16, kv_lora_rank=12, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10,
        max_position_embeddings=64, initializer_range=0.2)).eval()
    hf.model.layers[3].mlp.gate.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, 16))
    return hf


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
@torch.no_grad()
def test_omitted_fields_take_family_defaults(tmp_path, family):
    torch.manual_seed(2)
    hf = _mixtral_defaults_model() if family == "mixtral" else _deepseek_defaults_model()
    hf.save_pretrained(tmp_path)
    gone = _strip_defaults(tmp_path, type(hf.config))
    assert {"rope_parameters", "rms_norm_eps", "tie_word_embeddings"} <= set(gone)
    if family == "deepseek_v3":
        assert {"routed_scaling_factor", "n_group", "topk_group", "first_k_dense_replace"} <= set(gone)
    ncfg, model = load_hf_checkpoint(tmp_path)
    assert ncfg.rope_theta == hf.config.rope_parameters["rope_theta"] and ncfg.norm_eps == hf.config.rms_norm_eps
    ref = hf(tokens()).logits
    assert ref.abs().max() > 1.0
    torch.testing.assert_close(model.eval()(tokens()), ref, atol=1e-5, rtol=0)


def test_llama_omitted_fields_take_llama_defaults():
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=4)
    hf = {k: v for k, v in cfg.to_dict().items()
          if k not in ("rope_parameters", "rms_norm_eps", "num_key_value_heads", "head_dim")}
    ncfg = config_from_hf(hf)
    assert (ncfg.rope_theta, ncfg.norm_eps, ncfg.kv_heads) == (LlamaConfig().rope_parameters["rope_theta"],
                                                               LlamaConfig().rms_norm_eps, 4)


def test_without_transformers_missing_fields_raise(monkeypatch):
    hf = {k: v for k, v in _mixtral_defaults_model().config.to_dict().items()
          if k not in ("rope_parameters", "rms_norm_eps")}
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(ValueError, match="rms_norm_eps"):
        config_from_hf_moe(hf)
    with pytest.raises(ValueError, match="rope_theta"):
        config_from_hf_moe(dict(hf, rms_norm_eps=1e-5))
    assert config_from_hf_moe(dict(hf, rms_norm_eps=1e-5, rope_theta=1e6)).rope_theta == 1e6
