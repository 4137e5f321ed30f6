"""Planner v2: counts pinned to the built model, hardware table and overrides, search over any
divisor, stated precision. Pure Python except the meta-device builds (allocate nothing)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ndtrain.model
from ndtrain.cli.plan import main as plan_main
from ndtrain.config import load_config
from ndtrain.planner import Cluster, Workload, evaluate, parse_layout, search
from ndtrain.planner.diagnose import diagnose
from ndtrain.planner.hardware import HARDWARE, apply_overrides, get_accelerator
from ndtrain.planner.layout import layout_assumptions
from ndtrain.planner.model_spec import ModelSpec, from_model_config, load_model_spec
from ndtrain.planner.search import candidate_layouts, divisors, tp_degrees
from tests.flops_reference import config_flops_per_token

PRESETS = sorted(p.stem for p in (Path(ndtrain.__file__).parent / "configs").glob("*.yaml"))


# ---- 1. counts pinned to the model ------------------------------------------------------------
@pytest.mark.parametrize("preset", PRESETS)
def test_counts_equal_built_model(preset):
    cfg = load_config(preset)
    with torch.device("meta"):
        model = ndtrain.model.Transformer(cfg.model)
    distinct = {id(p): p for p in model.parameters()}.values()
    spec = from_model_config(cfg.model)
    assert spec.params_total == sum(p.numel() for p in distinct)
    for T in (cfg.data.seq_len, 4096):
        assert spec.flops_per_token(T) == config_flops_per_token(cfg.model, T)  # the MFU's count, too


def test_presets_cover_mtp_and_mla():
    """The parametrised test above must cover the parts the planner used to leave out."""
    cfgs = [load_config(p).model for p in PRESETS]
    assert any(c.mtp_depth for c in cfgs) and any(c.attention == "mla" for c in cfgs)


def test_deepseek_v3_mtp_and_latent_norms_by_hand():
    spec = from_model_config(load_config("deepseek_v3").model)
    d, V = 7168, 129280
    # MTP: 3 norms + proj (C, 2C) + one MoE block (the last layer's kind); latent norms 1536 + 512
    block = spec.layer_params(True)
    assert spec.mtp_params() == 3 * d + 2 * d * d + block
    no_mtp = spec.params_total - spec.mtp_params()
    assert no_mtp / 1e9 == pytest.approx(671.03, abs=0.01)
    assert spec.params_total == 682_636_472_320
    # latent norms: 61 layers x (1536 + 512) weights that the old count left out
    assert spec.attn_params - (d * 1536 + 1536 * 128 * 192 + d * (512 + 64) + 512 * 128 * 256
                               + 128 * 128 * d + d) == 1536 + 512
    # FLOPs: the MTP depth runs its block and the head once more, and adds one attention layer
    extra = 6 * (spec.mtp_params(active=True) + V * d) + spec.attention_flops_per_layer(4096)
    base = spec.flops_per_token(4096) - extra
    assert extra / spec.flops_per_token(4096) == pytest.approx(0.0367, abs=0.001)
    assert base > 0


# ---- 2. hardware --------------------------------------------------------------------------------


@pytest.mark.parametrize("name,bf16,hbm,hbm_bw,intra", [
    ("H800", 989.4e12, 81559 * 2**20, 3.35e12, 200e9),  # NVLink cut to 400 GB/s bidirectional
    ("H100 SXM", 989.4e12, 81559 * 2**20, 3.35e12, 450e9),
    ("H100-NVL", 835.5e12, 94e9, 3.9e12, 300e9),
    ("H200", 989.4e12, 141e9, 4.8e12, 450e9),
    ("GH200", 989.4e12, 96e9, 4.0e12, 450e9),
    ("B200", 2.25e15, 180e9, 8e12, 900e9),
    ("GB200", 2.5e15, 186e9, 8e12, 900e9),
    ("MI300X", 1307.4e12, 192e9, 5.3e12, 448e9),
    ("TPU v4", 275e12, 32 * 2**30, 1.2e12, 300e9),
    ("tpu-v5p", 459e12, 95 * 2**30, 2.765e12, 600e9),
])
def test_hardware_entries(name, bf16, hbm, hbm_bw, intra):
    a = get_accelerator(name)
    assert (a.peak("bf16"), a.hbm_bytes, a.hbm_bytes_per_s, a.intra_node_bytes_per_s) == \
        pytest.approx((bf16, hbm, hbm_bw, intra))
    assert a.source


def test_every_entry_cites_a_source_and_fabric_domains():
    assert all(a.source for a in HARDWARE.values())
    assert get_accelerator("B200-NVL72").gpus_per_node == 72 and get_accelerator("B200").gpus_per_node == 8
    assert get_accelerator("TPUv4").gpus_per_node == 4096
    assert get_accelerator("TPUv5p").peak("fp8") == get_accelerator("TPUv5p").peak("bf16")  # no FP8 speedup
    with pytest.raises(KeyError):
        get_accelerator("TPUv4").peak("float8")


@pytest.mark.parametrize("spelling", ["TPUv4", "tpuv4", "TPU v4", "tpu-v4", "TPU_V4", "v4"])
def test_tpu_spellings_plan(spelling, capsys):
    assert get_accelerator(spelling).name == "TPUv4"
    assert plan_main(["--model", "debug", "--hardware", spelling, "--gpus", "8", "--top", "1"]) == 0
    assert "8 x TPUv4" in capsys.readouterr().out


def test_hardware_override_fields_and_unknown_key(capsys):
    a = apply_overrides(get_accelerator("H100"), "memory_gb=96, peak_tflops=900,inter_node_gbps=100,gpus_per_node=4")
    assert (a.hbm_bytes, a.peak("bfloat16"), a.peak("float16"), a.inter_node_bytes_per_s, a.gpus_per_node) == \
        (96e9, 900e12, 900e12, 100e9, 4)
    assert a.peak("float8") == 1978.9e12 and a.hbm_bytes_per_s == 3.35e12  # untouched fields stay
    with pytest.raises(ValueError, match="unknown key 'memroy_gb'.*memory_gb"):
        apply_overrides(a, "memroy_gb=96")
    with pytest.raises(ValueError, match="needs a number"):
        apply_overrides(a, "memory_gb=lots")
    assert plan_main(["--model", "debug", "--gpus", "8", "--hardware-override", "bogus=1"]) == 2
    assert "unknown key 'bogus'" in capsys.readouterr().err
    # the override reaches the plan: 1 GB of memory makes llama3_8b fit nowhere
    assert plan_main(["--model", "llama3_8b", "--gpus", "8", "--hardware-override", "memory_gb=1"]) == 1


# ---- 3. search over any divisor ------------------------------------------------------------------


def test_divisors_and_tp_degrees():
    assert divisors(6144, 16) == [1, 2, 3, 4, 6, 8, 12, 16]
    spec = ModelSpec("m", 32000, 3072, 24, 24, 8, 128, 8192)  # 24 heads, 8 kv heads
    node12 = Cluster(get_accelerator("H100"), 96, gpus_per_node=12)
    # 3, 6, 12: the 8 kv heads neither split over them nor divide them; 8 | 96 and 8 <= 12
    assert tp_degrees(spec, node12) == [1, 2, 4, 8]
    spec = ModelSpec("m", 32000, 3072, 24, 24, 24, 128, 8200)  # MHA; ffn 8200 = 8 * 1025, not % 3
    assert tp_degrees(spec, node12) == [1, 2, 4, 8]
    spec = ModelSpec("m", 32000, 3072, 24, 24, 24, 128, 8208)  # ffn 8208 = 2^4 * 3^3 * 19
    assert tp_degrees(spec, node12) == [1, 2, 3, 4, 6, 8, 12]


def test_issue_case_6144_gpus_2048_sequences_finds_non_power_of_two_layouts():
    """The issue's case: the factor 3 of 6,144 must go into TP or PP (dp divides 2,048)."""
    spec, _ = load_model_spec("llama3_405b")
    cluster, w = Cluster(get_accelerator("H100"), 6144), Workload(8192, 2048 * 8192)
    cands = candidate_layouts(spec, cluster, w)
    assert cands and all(c.pp % 3 == 0 or c.tp % 3 == 0 for c in cands)
    assert {c.pp for c in cands} >= {3, 6, 12, 24}
    best = search(spec, cluster, w, top=1)[0]
    assert best.fits and best.layout.pp % 3 == 0 and best.mfu > 0.3


def test_tp12_proposed_where_valid():
    spec = ModelSpec("m12", 32000, 6144, 24, 48, 12, 128, 16416)  # 48 heads, 12 kv heads, ffn % 12 == 0
    cluster = Cluster(get_accelerator("B200-NVL72"), 72)
    tps = {c.tp for c in candidate_layouts(spec, cluster, Workload(4096, 576 * 4096))}
    assert {3, 6, 12, 24} <= tps and 9 not in tps  # 9 divides 72 but not the 48 heads


def test_diagnose_names_the_failing_rule_when_no_candidate_exists(capsys):
    spec = ModelSpec("two_layers", 32000, 4096, 2, 32, 8, 128, 14336)  # pp <= 2, tp in {1, 2, 4, 8}
    cluster, w = Cluster(get_accelerator("H100"), 6144), Workload(8192, 2048 * 8192)
    assert search(spec, cluster, w) == []
    lines = diagnose(spec, cluster, w)
    text = "\n".join(lines)
    assert lines[0].startswith("no valid layout: all 12 meshes")
    assert "global_batch_size (2048) is not divisible by the data-parallel degree" in text
    assert "n_heads (32) is not divisible by tp (3)" in text
    assert "fits in memory" not in text


def test_diagnose_reports_memory_when_valid_meshes_do_not_fit():
    spec, _ = load_model_spec("llama3_405b")
    cluster, w = Cluster(get_accelerator("H100"), 8), Workload(8192, 64 * 8192)
    assert search(spec, cluster, w) == []
    line = diagnose(spec, cluster, w)[0]
    assert "valid but none fits in memory" in line and "GiB of 79.6" in line
    # 3 GPUs, 4 sequences: PP3 is valid (and too small); DP3 and TP3 are named with their rules
    lines = diagnose(spec, Cluster(get_accelerator("H100"), 3), Workload(8192, 4 * 8192))
    assert lines[0].startswith("1 of 3 meshes are valid") and lines[1] == "the other 2 break a rule:"
    assert any("(DP3): global_batch_size (4) is not divisible by the data-parallel degree" in x for x in lines)
    assert any("(TP3 DP1): n_heads (128) is not divisible by tp (3)" in x for x in lines)


def test_cli_prints_diagnosis_instead_of_memory(capsys, tmp_path):
    cfg = {"hidden_size": 4096, "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 8,
           "intermediate_size": 14336, "vocab_size": 32000}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    rc = plan_main(["--model", str(path), "--gpus", "6144", "--seq-len", "8192",
                    "--global-batch-tokens", str(2048 * 8192)])
    out = capsys.readouterr().out
    assert rc == 1 and "no valid layout" in out and "no layout fits in memory" not in out


def test_dp_shard_layout_without_zero_stage_states_assumption(capsys):
    lay = parse_layout("tp=2,dp_shard=4")
    assert "assuming zero_stage=0" in layout_assumptions("tp=2,dp_shard=4", lay)[0]
    assert "dp_shard x cp = 4" in layout_assumptions("tp=2,dp_shard=4", lay)[0]
    assert layout_assumptions("dp_shard=4,zero_stage=3", parse_layout("dp_shard=4,zero_stage=3")) == []
    assert layout_assumptions("tp=8", parse_layout("tp=8,dp_shard=1")) == []
    plan_main(["--model", "llama3_8b", "--gpus", "8", "--layout", "dp_shard=8"])
    assert "assumed: zero_stage not given: assuming zero_stage=0" in capsys.readouterr().out


# ---- 4. precision stated ------------------------------------------------------------------------
def test_fp8_mfu_against_bf16_peak_and_only_block_linears_faster(capsys):
    spec, _ = load_model_spec("llama3_70b")
    w, lay = Workload(8192, 1024 * 8192), parse_layout("tp=8,pp=4,dp_shard=8,zero_stage=1,ac=none")
    bf = evaluate(spec, Cluster(get_accelerator("H100"), 256), w, lay)
    f8 = evaluate(spec, Cluster(get_accelerator("H100"), 256, dtype="float8"), w, lay)
    assert bf.mfu == bf.mfu_vs_dtype_peak
    assert f8.mfu_vs_dtype_peak == pytest.approx(f8.mfu * 989.4 / 1978.9)
    # the step is faster but not twice: attention and the head stay at the bf16 rate, the casts
    # are added (test_planner_v3.py), comm unchanged
    c_bf, c_f8 = bf.step.parts["compute"], f8.step.parts["compute"]
    assert 0.6 * c_bf < c_f8 < 0.85 * c_bf
    assert f8.step.parts["tp_comm"] >= bf.step.parts["tp_comm"] * 0.99
    assert f8.mfu > bf.mfu and f8.to_dict()["mfu_vs_dtype_peak"] == f8.mfu_vs_dtype_peak
    assert plan_main(["--model", "llama3_8b", "--gpus", "8", "--dtype", "float8", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "FP8 peak (1,979 TFLOP/s)" in out and "against the bf16 dense peak" in out
    assert "output head" in out and "attention" in out
    assert plan_main(["--model", "llama3_8b", "--gpus", "8", "--dtype", "float8", "--top", "1", "--json"]) == 0
    row = json.loads(capsys.readouterr().out.splitlines()[0])
    assert row["mfu_vs_dtype_peak"] == pytest.approx(row["mfu"] * 989.4 / 1978.9)


def test_mixer_only_blocks_count_one_norm():
    """``model.block_ffn=false`` (Mamba-2 blocks): no feed-forward and no second RMSNorm, as built."""
    from ndtrain.config import ModelConfig

    cfg = ModelConfig(vocab_size=128, dim=32, n_layers=2, n_heads=4, layer_pattern="M", block_ffn=False,
                      mamba_head_dim=8, mamba_state_dim=8, mamba_groups=2)
    with torch.device("meta"):
        model = ndtrain.model.Transformer(cfg)
    spec = from_model_config(cfg)
    assert spec.params_total == sum(p.numel() for p in model.parameters())
    assert spec.flops_per_token(32) == config_flops_per_token(cfg, 32)
