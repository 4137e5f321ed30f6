"""Parity with Hugging Face Qwen3-MoE (transformers' ``Qwen3MoeForCausalLM``, tiny models built
locally), both ways.

Reference: float32, eager CPU, random weights with initializer_range 0.2 (logits O(5), routing far
from uniform) and the RMSNorm gains (q_norm / k_norm included) perturbed away from 1, so a missing
or misplaced QK-norm, a wrong head_dim, a wrong MoE layer set (decoder_sparse_step /
mlp_only_layers) or a wrong top-k renormalisation changes logits by O(1); both sides do the same
float32 operations in different summation orders, so atol 1e-5 pins them.
"""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3MoeForCausalLM"):
    pytest.skip(f"transformers {transformers.__version__} has no Qwen3MoeForCausalLM", allow_module_level=True)
from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from ndtrain.config import Config, DataConfig, ModelConfig, ParallelConfig
from ndtrain.config.validate import validate
from ndtrain.hf.folder import load_hf_checkpoint, save_hf_checkpoint
from ndtrain.hf.qwen3_moe import config_from_hf_qwen3_moe, config_to_hf_qwen3_moe
from ndtrain.model import build_model
from tests.hf_utils import assert_hf_round_trip_exact, assert_same_state


def tokens():
    return torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))


def _tiny(**kw) -> Qwen3MoeForCausalLM:
    args = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=12, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                max_position_embeddings=64, initializer_range=0.2, rope_parameters={"rope_type": "default",
                                                                                    "rope_theta": 1e4})
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**dict(args, **kw))).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return hf


@pytest.mark.parametrize("sparse_step,mlp_only,norm_topk,moe_layers", [
    (2, [], True, [1, 3]),          # every 2nd layer from layer 1, top-k renormalised
    (1, [0], False, [1, 2, 3]),     # first layer dense (mlp_only_layers), raw softmax weights
])
@torch.no_grad()
def test_import_logits_match(tmp_path, sparse_step, mlp_only, norm_topk, moe_layers):
    torch.manual_seed(0)
    hf = _tiny(decoder_sparse_step=sparse_step, mlp_only_layers=mlp_only, norm_topk_prob=norm_topk)
    hf.save_pretrained(tmp_path)
    ncfg, model = load_hf_checkpoint(tmp_path)
    assert ncfg.qk_norm and ncfg.head_dim == 12 != ncfg.dim // ncfg.n_heads
    assert [i for i in range(4) if ncfg.is_moe_layer(i)] == moe_layers
    assert (ncfg.moe_experts, ncfg.moe_top_k, ncfg.moe_renormalize, ncfg.moe_shared_experts) == (8, 2, norm_topk, 0)
    validate(Config(model=ncfg, data=DataConfig(seq_len=32)))
    ref = hf(tokens()).logits
    assert ref.abs().max() > 1.0
    torch.testing.assert_close(model.eval()(tokens()), ref, atol=1e-5, rtol=0)


@torch.no_grad()
def test_native_model_exports_to_transformers(tmp_path):
    """An ndtrain-built model (MoE layers 0 and 2: off HF's (i+1) % k grid, so written as
    decoder_sparse_step 1 + mlp_only_layers) loads in transformers with the same logits, and
    re-imports to the same tensors."""
    cfg = ModelConfig(name="qwen3_moe", vocab_size=128, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=40,
                      attn_head_dim=12, qk_norm=True, norm_eps=1e-6, rope_theta=1e4, max_seq_len=64, moe_experts=4,
                      moe_top_k=2, moe_ffn_hidden=16, moe_renormalize=False, moe_layer_interleave=2, init_std=0.2)
    validate(Config(model=cfg, data=DataConfig(seq_len=32)))
    model = build_model(cfg, seed=3).eval()
    for name, p in model.named_parameters():
        if "norm" in name:
            p.add_(0.3 * torch.randn_like(p))
    save_hf_checkpoint(model, cfg, tmp_path)
    hf_cfg = json.loads((tmp_path / "config.json").read_text())
    assert (hf_cfg["decoder_sparse_step"], hf_cfg["mlp_only_layers"], hf_cfg["head_dim"]) == (1, [1, 3], 12)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    ref = model(tokens())
    assert ref.abs().max() > 1.0
    torch.testing.assert_close(hf(tokens()).logits, ref, atol=1e-5, rtol=0)
    ncfg, back = load_hf_checkpoint(tmp_path)
    assert [ncfg.is_moe_layer(i) for i in range(4)] == [cfg.is_moe_layer(i) for i in range(4)]
    assert_same_state(model, back)


@torch.no_grad()
def test_transformers_round_trip_keeps_tensors(tmp_path):
    """HF -> ndtrain -> HF writes back the same tensors (per-expert layout) and config."""
    torch.manual_seed(1)
    hf = _tiny(decoder_sparse_step=2)
    cfg = assert_hf_round_trip_exact(hf, tmp_path)
    assert config_from_hf_qwen3_moe(config_to_hf_qwen3_moe(cfg)) == cfg


@torch.no_grad()
def test_omitted_fields_take_qwen3_defaults(tmp_path):
    torch.manual_seed(2)
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        initializer_range=0.2)).eval()  # rms_norm_eps 1e-6, rope_theta 1e4, max positions 32768: defaults
    hf.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    full, defaults = json.loads(path.read_text()), Qwen3MoeConfig().to_dict()
    gone = [k for k, v in full.items() if k not in ("model_type", "architectures") and defaults.get(k, object()) == v]
    path.write_text(json.dumps({k: v for k, v in full.items() if k not in gone}))
    assert {"rope_parameters", "rms_norm_eps", "max_position_embeddings", "norm_topk_prob"} <= set(gone)
    ncfg, model = load_hf_checkpoint(tmp_path)
    assert (ncfg.rope_theta, ncfg.norm_eps, ncfg.max_seq_len) == (1e4, 1e-6, 32768)
    torch.testing.assert_close(model.eval()(tokens()), hf(tokens()).logits, atol=1e-5, rtol=0)


def test_unsupported_configs_rejected():
    base = config_to_hf_qwen3_moe(ModelConfig(dim=32, n_heads=4, qk_norm=True, moe_experts=4, ffn_hidden=48))
    for bad in ({"use_sliding_window": True, "sliding_window": 16}, {"attention_bias": True},
                {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                     "original_max_position_embeddings": 512}},
                {"num_hidden_layers": 4, "mlp_only_layers": [1]},  # MoE layers 0, 2, 3: no start / interleave
                {"model_type": "qwen3"}):
        with pytest.raises(ValueError):
            config_from_hf_qwen3_moe(dict(base, **bad))
    with pytest.raises(ValueError, match="qk_norm"):  # an export without QK-norm is not Qwen3
        config_to_hf_qwen3_moe(ModelConfig(dim=32, n_heads=4, moe_experts=4))
    # QK-norm under tp: the gains stay whole, their gradients summed (tests/parallel/test_mixers_tp_pp.py)
    validate(Config(model=ModelConfig(qk_norm=True), parallel=ParallelConfig(tp=2)), world_size=2)


def test_convert_from_hf(tmp_path):
    """``ndtrain convert --from-hf`` on a Qwen3-MoE folder writes a config with QK-norm, the head
    dim and the MoE layer set, which validates."""
    import yaml

    from ndtrain.cli.convert import from_hf
    from ndtrain.config import config_from_dict

    torch.manual_seed(3)
    _tiny(decoder_sparse_step=2).save_pretrained(tmp_path / "hf")
    out = from_hf(tmp_path / "hf", tmp_path / "ckpt")
    cfg = config_from_dict(yaml.safe_load((out / "config.yaml").read_text()))
    m = cfg.model
    assert (m.qk_norm, m.attn_head_dim, m.moe_layer_start, m.moe_layer_interleave) == (True, 12, 1, 2)
    cfg.data.seq_len = 32
    validate(cfg)


def test_flops_count_qk_norm_and_head_dim():
    """metrics.flops_per_token = 6 x the non-embedding parameters (q / k norms, head_dim 24 != 64 / 4;
    every expert active) + the attention term 6 H (D + D) T."""
    from ndtrain.train.metrics import flops_per_token

    cfg = ModelConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, qk_norm=True, attn_head_dim=24,
                      ffn_hidden=96, moe_experts=4, moe_top_k=4, moe_ffn_hidden=32, moe_layer_start=1)
    params = sum(p.numel() for n, p in build_model(cfg).named_parameters() if not n.startswith("tok_embeddings"))
    assert flops_per_token(cfg, 32) == 6 * params + cfg.n_layers * 6 * 4 * (24 + 24) * 32
