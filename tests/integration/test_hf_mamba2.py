"""Parity with Hugging Face Mamba-2 (transformers' ``Mamba2ForCausalLM``, tiny models built locally),
both ways, to 1e-4 in float32 (the observed gap is ~2e-6 at logits of magnitude ~4).

The HF model's SSM parameters are moved off their structured init (A_log, dt_bias random, D, conv
bias and every RMSNorm gain perturbed) so that a swapped in_proj slice (z / x / B / C / dt), a
wrong B / C group for a head (``n_groups`` 2), a norm over the whole inner width instead of per
group, or a missing D skip changes logits by O(1). Length 21 with chunk size 8 covers whole chunks
and a partial one.
"""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Mamba2ForCausalLM"):
    pytest.skip(f"transformers {transformers.__version__} has no Mamba2ForCausalLM", allow_module_level=True)
from transformers import AutoModelForCausalLM, Mamba2Config, Mamba2ForCausalLM

from ndtrain.config import Config, DataConfig, ModelConfig
from ndtrain.config.validate import validate
from ndtrain.errors import ConfigError
from ndtrain.hf.folder import load_hf_checkpoint, save_hf_checkpoint
from ndtrain.hf.mamba2 import config_from_hf_mamba2, config_to_hf_mamba2
from ndtrain.inference.generate import KVCache
from ndtrain.model import build_model
from tests.hf_utils import assert_hf_round_trip_exact, assert_same_state


def tokens(t: int = 21):
    return torch.randint(0, 128, (2, t), generator=torch.Generator().manual_seed(0))


def _tiny(**kw) -> Mamba2ForCausalLM:
    args = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_heads=8, head_dim=8, state_size=16,
                expand=2, n_groups=2, conv_kernel=4, chunk_size=8, initializer_range=0.2)
    hf = Mamba2ForCausalLM(Mamba2Config(**dict(args, **kw))).eval()
    _perturb(hf)
    return hf


@torch.no_grad()
def _perturb(model: torch.nn.Module) -> None:
    for name, p in model.named_parameters():
        if "norm" in name or name.endswith(".D") or "conv1d.bias" in name:
            p.add_(0.3 * torch.randn_like(p))
        elif "dt_bias" in name:
            p.copy_(torch.randn_like(p))
        elif "A_log" in name:
            p.copy_(2.0 * torch.rand_like(p))


@pytest.mark.parametrize("groups,tie", [(2, False), (1, True)])
@torch.no_grad()
def test_import_logits_match(tmp_path, groups, tie):
    torch.manual_seed(0)
    hf = _tiny(n_groups=groups, tie_word_embeddings=tie)
    hf.save_pretrained(tmp_path)
    ncfg, model = load_hf_checkpoint(tmp_path)
    assert (ncfg.layer_pattern, ncfg.block_ffn, ncfg.mamba_groups, ncfg.tie_embeddings) == ("M", False, groups, tie)
    assert all(layer.feed_forward is None for layer in model.layers.values())
    validate(Config(model=ncfg, data=DataConfig(seq_len=32)))
    ref = hf(tokens()).logits
    assert ref.abs().max() > 1.0
    torch.testing.assert_close(model.eval()(tokens()), ref, atol=1e-4, rtol=0)


@torch.no_grad()
def test_native_model_exports_and_decodes(tmp_path):
    """An ndtrain-built Mamba-2 (2 groups) loads in transformers with the same logits and
    re-imports to the same tensors; its recurrent decode equals its full forward."""
    cfg = ModelConfig(name="mamba2", vocab_size=128, dim=32, n_layers=2, n_heads=4, layer_pattern="M",
                      block_ffn=False, mamba_head_dim=8, mamba_state_dim=8, mamba_groups=2, linear_chunk_size=8,
                      norm_eps=1e-5, max_seq_len=64, init_std=0.2)
    validate(Config(model=cfg, data=DataConfig(seq_len=32)))
    model = build_model(cfg, seed=3).eval()
    _perturb(model)
    save_hf_checkpoint(model, cfg, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == "Mamba2ForCausalLM" and hf.config.n_groups == 2
    ref = model(tokens())
    assert ref.abs().max() > 1.0
    torch.testing.assert_close(hf(tokens()).logits, ref, atol=1e-4, rtol=0)
    _, back = load_hf_checkpoint(tmp_path)
    assert_same_state(model, back)
    cache, steps = KVCache(2, 64), []
    for i in range(tokens().shape[1]):  # token by token through the conv window and the SSM state
        steps.append(model(tokens()[:, i:i + 1], kv_cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), ref, atol=1e-4, rtol=0)


@torch.no_grad()
def test_transformers_round_trip_keeps_tensors(tmp_path):
    torch.manual_seed(1)
    hf = _tiny()
    cfg = assert_hf_round_trip_exact(hf, tmp_path)
    assert config_from_hf_mamba2(config_to_hf_mamba2(cfg)) == cfg


@torch.no_grad()
def test_omitted_fields_take_mamba2_defaults(tmp_path):
    torch.manual_seed(2)  # layer_norm_epsilon, conv_kernel, expand, chunk_size, time_step_limit: defaults
    hf = Mamba2ForCausalLM(Mamba2Config(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_heads=4,
                                        head_dim=16, state_size=8, n_groups=1, initializer_range=0.2)).eval()
    _perturb(hf)
    hf.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    full, defaults = json.loads(path.read_text()), Mamba2Config().to_dict()
    gone = [k for k, v in full.items() if k not in ("model_type", "architectures") and defaults.get(k, object()) == v]
    path.write_text(json.dumps({k: v for k, v in full.items() if k not in gone}))
    assert {"layer_norm_epsilon", "conv_kernel", "expand", "chunk_size"} <= set(gone)
    ncfg, model = load_hf_checkpoint(tmp_path)
    assert (ncfg.norm_eps, ncfg.linear_conv_kernel, ncfg.linear_chunk_size) == (1e-5, 4, 256)
    torch.testing.assert_close(model.eval()(tokens()), hf(tokens()).logits, atol=1e-4, rtol=0)


def test_unsupported_configs_rejected():
    base = config_to_hf_mamba2(ModelConfig(dim=32, n_heads=4, layer_pattern="M", block_ffn=False, mamba_head_dim=8))
    for bad in ({"use_bias": True}, {"hidden_act": "gelu"}, {"time_step_limit": [0.0, 10.0]},
                {"num_heads": 4}, {"expand": 1.5}, {"model_type": "mamba"}):
        with pytest.raises(ValueError):
            config_from_hf_mamba2(dict(base, **bad))
    for hybrid in (ModelConfig(layer_pattern="MA", block_ffn=False), ModelConfig(layer_pattern="M")):
        with pytest.raises(ValueError, match="Mamba-2 export needs"):
            config_to_hf_mamba2(hybrid)
    with pytest.raises(ConfigError, match="block_ffn false"):
        validate(Config(model=ModelConfig(block_ffn=False, moe_experts=4)))


def test_convert_from_hf(tmp_path):
    """``ndtrain convert --from-hf`` on a Mamba-2 folder writes a config carrying the Mamba-2 shape
    (mixer-only blocks, groups) that validates, and the weights under ndtrain names."""
    import yaml

    from ndtrain.cli.convert import from_hf
    from ndtrain.config import config_from_dict

    torch.manual_seed(3)
    _tiny().save_pretrained(tmp_path / "hf")
    out = from_hf(tmp_path / "hf", tmp_path / "ckpt")
    cfg = config_from_dict(yaml.safe_load((out / "config.yaml").read_text()))
    assert (cfg.model.layer_pattern, cfg.model.block_ffn, cfg.model.mamba_groups) == ("M", False, 2)
    cfg.data.seq_len = 32
    validate(cfg)
    assert json.loads((out / "meta.json").read_text())["step"] == 0


def test_flops_count_the_mixer_only_block():
    """metrics.flops_per_token = 6 x the non-embedding parameters (no feed-forward, grouped B / C)
    + the SSD term 6 n_h 2 N P per layer; the planner's spec has no FFN either."""
    from ndtrain.planner.model_spec import from_model_config
    from ndtrain.train.metrics import flops_per_token

    cfg = ModelConfig(vocab_size=128, dim=32, n_layers=2, n_heads=4, layer_pattern="M", block_ffn=False,
                      mamba_head_dim=8, mamba_state_dim=8, mamba_groups=2)
    params = sum(p.numel() for n, p in build_model(cfg).named_parameters() if not n.startswith("tok_embeddings"))
    ssd = cfg.n_layers * 6 * 8 * 2 * 8 * 8  # 8 heads of P 8, N 8
    assert flops_per_token(cfg, 32) == 6 * params + ssd
    assert from_model_config(cfg).ffn_hidden == 0
