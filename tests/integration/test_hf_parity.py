"""Parity with Hugging Face ``LlamaForCausalLM`` (transformers, built locally with random weights).

Reference: transformers' Llama implementation, float32, eager CPU. Tolerance atol 1e-5 on logits of
magnitude ~5 (initializer_range 0.2): both sides run the same float32 operations (RMSNorm in fp32,
rotate-half RoPE from identically computed fp32 tables, SDPA, SwiGLU), so only summation order in
matmul / attention kernels may differ; 1e-5 is a few ulps at that magnitude and far below the
effect of any real mismatch (a wrong RoPE pairing or scaling changes logits by O(1)).
"""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM

from ndtrain.hf.folder import load_hf_checkpoint, save_hf_checkpoint
from ndtrain.hf.llama import config_from_hf, config_to_hf, state_dict_from_hf, state_dict_to_hf
from ndtrain.model import build_model

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 32}  # short, so a 48-token input crosses it


def hf_config(scaling: bool, tie: bool) -> LlamaConfig:
    return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                       rope_theta=500000.0, rope_scaling=LLAMA3_SCALING if scaling else None,
                       tie_word_embeddings=tie, initializer_range=0.2, rms_norm_eps=1e-5)


def tokens():
    return torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))


CASES = [(False, False), (True, False), (False, True), (True, True)]


@pytest.mark.parametrize("scaling,tie", CASES)
@torch.no_grad()
def test_import_from_hf(tmp_path, scaling, tie):
    torch.manual_seed(0)
    hf = LlamaForCausalLM(hf_config(scaling, tie)).eval()
    shard = "40KB" if scaling and not tie else None  # one case reads a sharded checkpoint + index
    hf.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    if shard:
        assert (tmp_path / "model.safetensors.index.json").exists()
    cfg, model = load_hf_checkpoint(tmp_path)
    assert cfg.rope_scaling == scaling and cfg.tie_embeddings == tie and cfg.kv_heads == 2
    assert (model.output.weight is model.tok_embeddings.weight) == tie
    ref = hf(tokens()).logits
    assert ref.abs().max() > 1.0
    torch.testing.assert_close(model(tokens()), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("scaling,tie", CASES)
@torch.no_grad()
def test_export_to_hf(tmp_path, scaling, tie):
    cfg = config_from_hf(hf_config(scaling, tie).to_dict())
    model = build_model(cfg, seed=1).eval()
    save_hf_checkpoint(model, cfg, tmp_path)
    hf = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert hf.config.tie_word_embeddings == tie
    assert hf.config.rope_parameters["rope_type"] == ("llama3" if scaling else "default")
    torch.testing.assert_close(model(tokens()), hf(tokens()).logits, atol=1e-5, rtol=0)


def test_config_and_state_dict_round_trip():
    cfg = config_from_hf(hf_config(True, False).to_dict())
    back = config_from_hf(json.loads(json.dumps(config_to_hf(cfg))))
    assert back == cfg
    model = build_model(cfg, seed=2)
    sd = model.state_dict()
    hf_sd = state_dict_to_hf(sd, cfg)
    assert "model.layers.1.self_attn.k_proj.weight" in hf_sd and len(hf_sd) == len(sd)
    again = state_dict_from_hf(hf_sd, cfg)
    assert again.keys() == sd.keys() and all(torch.equal(again[k], sd[k]) for k in sd)
    with pytest.raises(KeyError):
        state_dict_from_hf({k: v for k, v in hf_sd.items() if "norm" not in k}, cfg)


def test_unsupported_configs_rejected():
    base = hf_config(False, False).to_dict()
    for bad in ({"attention_bias": True}, {"hidden_act": "gelu"}, {"head_dim": 32},
                {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}, "rope_parameters": None}):
        with pytest.raises(ValueError):
            config_from_hf({**base, **bad})
