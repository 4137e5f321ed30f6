"""Hugging Face Qwen3-Next import / export (``ndtrain.hf.qwen3_next`` via ``ndtrain.hf.folder``).

A tiny ``Qwen3NextForCausalLM`` built here (4 layers, 3 Gated DeltaNet : 1 gated attention with
head_dim 32 != 64 / 4 and partial RoPE 0.25, grouped value heads, 4 experts top-2 plus a gated
shared expert of its own size, layer 0 dense via mlp_only_layers) gets every weight perturbed
(so the zero-centred norms, the gates, A_log / dt_bias are all non-trivial), is saved, imported,
and must give the same logits in float32 to 1e-4 of the logits' scale (the issue's bound; measured
~1e-6: only summation order differs, while a swapped q / gate half, a missing 1 + w, a wrong RoPE
slice or a wrong expert changes logits by O(1)). Export goes back through ``from_pretrained``;
an ndtrain-native model (no shared expert: exported as a zero one; MoE every other layer) is
checked the same way in the other direction.
"""
from __future__ import annotations

import json

import pytest
import torch
import yaml

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3NextForCausalLM"):
    pytest.skip(f"transformers {transformers.__version__} has no Qwen3NextForCausalLM", allow_module_level=True)
from transformers import AutoModelForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM

from ndtrain.cli.convert import from_hf
from ndtrain.config import Config, ModelConfig, config_from_dict
from ndtrain.config.validate import validate
from ndtrain.hf.common import read_safetensors
from ndtrain.hf.folder import load_hf_checkpoint, save_hf_checkpoint
from ndtrain.hf.qwen3_next import config_to_hf_qwen3_next, state_dict_from_hf_qwen3_next
from ndtrain.inference.generate import generate
from ndtrain.model import build_model

TOL = 1e-4


def tokens(t: int = 37) -> torch.Tensor:
    return torch.randint(0, 128, (2, t), generator=torch.Generator().manual_seed(0))


def close(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference relative to the logits' scale."""
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    """(HF model, its saved folder, imported cfg, imported ndtrain model)."""
    torch.manual_seed(0)
    hf = Qwen3NextForCausalLM(Qwen3NextConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, intermediate_size=96, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_num_value_heads=4, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        mlp_only_layers=[0], max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=5e4,
        full_attention_interval=4)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    folder = tmp_path_factory.mktemp("qwen3_next_hf")
    hf.save_pretrained(folder)
    cfg, model = load_hf_checkpoint(folder)
    return hf, folder, cfg, model.eval()


def test_config_mapping(hf_pair):
    _, _, cfg, _ = hf_pair
    assert (cfg.layer_pattern, cfg.attn_head_dim, cfg.rope_dim, cfg.qk_norm, cfg.attn_output_gate) == \
        ("GGGA", 32, 8, True, True)
    assert (cfg.linear_heads, cfg.linear_value_heads, cfg.linear_key_head_dim, cfg.linear_norm_eps) == (2, 4, 16, 1e-6)
    assert (cfg.moe_experts, cfg.moe_top_k, cfg.moe_ffn_hidden, cfg.moe_shared_ffn_hidden, cfg.moe_shared_gate) == \
        (4, 2, 32, 48, True)
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    full = Config(model=cfg)
    full.data.seq_len = 32
    validate(full)  # the imported model is a valid training config


def test_import_logits(hf_pair):
    hf, _, _, model = hf_pair
    ids = tokens()
    with torch.no_grad():
        ref = hf(ids).logits
        assert close(model(ids), ref) < TOL
        for layer in model.layers.values():  # several chunks and a partial one (37 = 2 * 16 + 5)
            layer.attention.chunk_size = 16
        got = model(ids)
        for layer in model.layers.values():
            layer.attention.chunk_size = 64
    assert close(got, ref) < TOL


def test_greedy_decoding_matches(hf_pair):
    """Cached decoding (recurrent GDN states, KV cache with the gate and partial RoPE at offsets)
    picks the tokens of the full recompute and of transformers' own cached greedy generate."""
    hf, _, _, model = hf_pair
    prompt = tokens(7)[0]
    cached = generate(model, prompt, 12)
    assert torch.equal(cached, generate(model, prompt, 12, use_cache=False))
    with torch.no_grad():
        ref = hf.generate(prompt[None], max_new_tokens=12, do_sample=False, min_new_tokens=12)[0]
    assert torch.equal(cached, ref)


def test_import_fused_expert_layout(hf_pair):
    """transformers 5 holds experts fused (gate_up_proj) in memory: importing its state dict gives
    the same tensors as the saved folder."""
    hf, folder, cfg, _ = hf_pair
    a = state_dict_from_hf_qwen3_next(hf.state_dict(), cfg)
    b = state_dict_from_hf_qwen3_next(read_safetensors(folder), cfg)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


def test_export_round_trip(hf_pair, tmp_path):
    hf, folder, cfg, model = hf_pair
    save_hf_checkpoint(model, cfg, tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(back).__name__ == "Qwen3NextForCausalLM"
    ids = tokens()
    with torch.no_grad():
        assert close(back(ids).logits, hf(ids).logits) < TOL
    orig, exported = read_safetensors(folder), read_safetensors(tmp_path)
    for k, v in orig.items():  # norms go through 1 + w and back: float32 rounding only
        torch.testing.assert_close(exported[k], v, rtol=0, atol=1e-6, msg=k)
    assert json.loads((tmp_path / "config.json").read_text())["mlp_only_layers"] == [0]


def test_export_native_model(tmp_path):
    """ndtrain -> HF: a model initialised here, MoE on layers 0 and 2, no shared expert."""
    cfg = ModelConfig(
        name="qwen3_next", vocab_size=128, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=96,
        norm_eps=1e-6, rope_theta=1e4, max_seq_len=64, layer_pattern="GA", linear_heads=2,
        linear_key_head_dim=16, linear_value_heads=4, linear_value_head_dim=8, attn_head_dim=24,
        qk_norm=True, attn_output_gate=True, rope_partial_factor=0.5, moe_experts=4, moe_top_k=2,
        moe_ffn_hidden=32, moe_layer_interleave=2, init_std=0.1)
    model = build_model(cfg, seed=3).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    save_hf_checkpoint(model, cfg, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert hf.config.layer_types == ["linear_attention", "full_attention"] * 2
    assert hf.config.mlp_only_layers == [1, 3]
    ids = tokens(21)
    with torch.no_grad():
        assert close(model(ids), hf(ids).logits) < TOL
    _, again = load_hf_checkpoint(tmp_path)  # and back: the same ndtrain tensors
    for k, v in model.state_dict().items():
        torch.testing.assert_close(again.state_dict()[k], v, rtol=0, atol=1e-6, msg=k)


def test_export_rejects_what_qwen3_next_lacks():
    base = {"dim": 64, "n_layers": 4, "n_heads": 4, "layer_pattern": "GGGA", "moe_experts": 4, "moe_ffn_hidden": 32}
    with pytest.raises(ValueError, match="qk_norm and attn_output_gate"):
        config_to_hf_qwen3_next(ModelConfig(**base))  # hybrid_debug-style attention: no gate, no q/k norm
    with pytest.raises(ValueError, match="moe_shared_gate"):
        config_to_hf_qwen3_next(ModelConfig(**base, qk_norm=True, attn_output_gate=True, moe_shared_experts=1))
    with pytest.raises(ValueError, match="uses \\['mamba2'\\]"):
        config_to_hf_qwen3_next(ModelConfig(dim=64, n_layers=4, n_heads=4, layer_pattern="GM"))


def test_convert_from_hf(hf_pair, tmp_path):
    """``ndtrain convert --from-hf`` writes a config that carries the Qwen3-Next options."""
    _, folder, _, _ = hf_pair
    out = from_hf(folder, tmp_path / "ckpt")
    m = config_from_dict(yaml.safe_load((out / "config.yaml").read_text())).model
    assert (m.layer_pattern, m.attn_output_gate, m.moe_shared_gate, m.rope_partial_factor) == ("GGGA", True, True, 0.25)
