"""Planner v3: a compute generation for every accelerator, the trainer's sequence-length rule,
float8 with its casts, per-mixer time for hybrids, the failure model (Young / Daly), and what to
try when nothing fits or divides."""
import json
import math
import random
from dataclasses import replace

import pytest

from ndtrain.cli.plan import main as plan_main
from ndtrain.config import ConfigError, load_config
from ndtrain.config.validate import validate
from ndtrain.planner import compute
from ndtrain.planner.accelerators import HARDWARE
from ndtrain.planner.compute import GENERATION_OF, attention_times, compute_constants, stage_op_times
from ndtrain.planner.diagnose import diagnose
from ndtrain.planner.goodput import LLAMA3_DAYS, LLAMA3_INTERRUPTIONS, goodput, young_interval
from ndtrain.planner.hardware import Cluster, get_accelerator
from ndtrain.planner.layout import Workload, check_layout, parse_layout
from ndtrain.planner.mixer_time import linear_core_times, stage_mixers
from ndtrain.planner.model_spec import load_model_spec
from ndtrain.planner.search import evaluate, search
from ndtrain.planner.suggest import alignment_warnings, nearest_batches, nearest_gpus
from ndtrain.planner.timing import estimate_step_time


# ---- 1. generations --------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(HARDWARE))
def test_every_hardware_entry_has_a_generation(name):
    acc = get_accelerator(name)
    assert name in GENERATION_OF
    c = compute_constants(acc)
    assert (c is None) == (name == "cpu")  # only cpu is the flat (measured) model, by name
    if c is not None:
        assert c.generation == GENERATION_OF[name] and c.source


def test_h100_96gb_is_timed_as_hopper_and_a_missing_generation_raises(monkeypatch):
    spec, _ = load_model_spec("llama3_8b")
    w, lay = Workload(8192, 64 * 8192), parse_layout("dp_shard=8,zero_stage=1")
    t80 = estimate_step_time(spec, Cluster(get_accelerator("H100"), 8), w, lay)
    t96 = estimate_step_time(spec, Cluster(get_accelerator("H100-96GB"), 8), w, lay)
    assert t96.parts["compute"] == t80.parts["compute"]  # same die: same per-operation model
    assert t96.compute_s["memory_bound"] > 0  # the flat v1 model has no memory-bound time
    monkeypatch.setitem(HARDWARE, "X9", replace(get_accelerator("H100"), name="X9"))
    with pytest.raises(KeyError, match="accelerator X9 has no compute generation"):
        compute_constants(HARDWARE["X9"])


def test_tpu_v4_and_v5p_have_their_own_gemm_constants():
    v4, v5p = compute_constants(get_accelerator("TPUv4")), compute_constants(get_accelerator("TPUv5p"))
    assert v4.generation == "tpu_v4" and v5p.generation == "tpu_v5p"
    assert v5p.gemm_efficiency > v4.gemm_efficiency


# ---- 2. the trainer's data.seq_len <= model.max_seq_len ----------------------------------------
def test_seq_len_beyond_max_seq_len_is_never_recommended():
    spec, _ = load_model_spec("llama3_8b")
    assert spec.max_seq_len == 131072
    rule = "data.seq_len (1048576) exceeds model.max_seq_len (131072)"
    cfg = load_config("llama3_8b")
    cfg.data.seq_len = 1048576
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert rule in str(e.value)  # the trainer's own text
    w = Workload(1048576, 16 * 1048576)
    lay = parse_layout("cp=8,tp=8,dp_shard=1")
    assert check_layout(spec, 64, w, lay, runtime=False) == []  # the planner can model it
    assert check_layout(spec, 64, w, lay) == [rule]
    assert search(spec, Cluster(get_accelerator("H100"), 64), w) == []
    modelled = search(spec, Cluster(get_accelerator("H100"), 64), w, include_unsupported=True)
    assert modelled and all(rule in p.unsupported for p in modelled)
    assert diagnose(spec, Cluster(get_accelerator("H100"), 64), w)[0].startswith(f"every layout: {rule}")
    assert check_layout(spec, 64, Workload(131072, 16 * 131072), lay) == []


# ---- 3. float8: only GEMMs speed up --------------------------------------------------------------
def test_fp8_gain_on_a_70b_layout_between_1_2_and_1_5():
    spec, _ = load_model_spec("llama3_70b")
    w, lay = Workload(8192, 1024 * 8192), parse_layout("tp=8,pp=4,dp_shard=8,zero_stage=1,ac=none")
    bf = evaluate(spec, Cluster(get_accelerator("H100"), 256), w, lay)
    f8 = evaluate(spec, Cluster(get_accelerator("H100"), 256, dtype="float8"), w, lay)
    gain = bf.step.step_time_s / f8.step.step_time_s
    assert 1.2 < gain < 1.5, gain
    cl = Cluster(get_accelerator("H100"), 256, dtype="float8")
    ops8, _ = stage_op_times(spec, cl, 8192, lay, 20, 0, False)
    ops16, _ = stage_op_times(spec, Cluster(get_accelerator("H100"), 256), 8192, lay, 20, 0, False)
    assert ops16.fp8_fwd == ops16.fp8_bwd == 0 and ops8.fp8_fwd > 0 and ops8.fp8_bwd > 0
    assert ops8.attn_fwd == ops16.attn_fwd and ops8.mem_fwd == ops16.mem_fwd  # unquantised ops stay
    # the casts: 6 bytes per bf16 element of x (m x k) and W (k x n) of each block GEMM forward
    tok, c = 8192, compute.GENERATIONS["hopper"]
    elems = sum(t * (m * k + k * n) for m, n, k, t in compute.block_gemms(spec, tok, 8, 1, False))
    assert ops8.fp8_fwd == pytest.approx(20 * 6 * elems / (3.35e12 * c.hbm_efficiency))


# ---- 6. hybrids: linear mixers without a T^2 term --------------------------------------------------
def test_hybrid_at_128k_costs_its_linear_layers_without_t_squared():
    spec, _ = load_model_spec("qwen3_next_80b")
    mix = stage_mixers(spec, range(spec.n_layers))
    assert mix == (("attention", 12), ("gated_deltanet", 36))
    cl, lay = Cluster(get_accelerator("H100"), 8), parse_layout("tp=8,dp_shard=1")
    acc, c = cl.accelerator, compute_constants(cl.accelerator)
    got = {}
    for T in (4096, 131072):
        hyb, af = stage_op_times(spec, cl, T, lay, 0, spec.n_layers, False, 0.0, mix)
        soft, _ = stage_op_times(spec, cl, T, lay, 0, spec.n_layers, False, 0.0, None)
        lin = linear_core_times(spec, "gated_deltanet", T, 8, 989.4e12, acc.hbm_bytes_per_s, c, 1.0)
        assert af == attention_times(spec, T, T, 8, 989.4e12, acc.hbm_bytes_per_s, c, acc.attention_gemm_ratio)[0]
        assert hyb.attn_fwd == pytest.approx(12 * af + 36 * lin[0])
        assert hyb.gemm_fwd != soft.gemm_fwd  # the DeltaNet projections, not attention's
        got[T] = (lin[0], af, hyb.attn_fwd, soft.attn_fwd)
    assert got[131072][0] == pytest.approx(32 * got[4096][0])  # linear in tokens: no T term
    assert got[131072][1] > 500 * got[4096][1]  # softmax: ~32^2
    assert got[131072][2] < 0.3 * got[131072][3]  # 36 of 48 layers are not softmax


# ---- 4. goodput --------------------------------------------------------------------------------
def test_checkpoint_interval_and_interruptions_of_a_16k_gpu_run():
    job_mttf = LLAMA3_DAYS * 86400 / LLAMA3_INTERRUPTIONS  # Llama 3: 466 in 54 days on 16,384 GPUs
    g = goodput(50 * 86400, 16384, 0, save_s=60, load_s=120, restart_s=600)
    assert g.job_mttf_s == pytest.approx(job_mttf)
    assert g.interval_s == pytest.approx(math.sqrt(2 * 60 * job_mttf)) == young_interval(60, job_mttf)
    assert 1090 < g.interval_s < 1100  # ~18 minutes
    # Daly's expectation against a simulation of the same process: each interval of work + its
    # save runs until a failure (exponential), which costs the time spent plus a recovery that
    # can fail too
    rng, wall = random.Random(0), 0.0
    for _ in range(round(g.work_s / g.interval_s)):
        while (t := rng.expovariate(1 / job_mttf)) < g.interval_s + 60:
            wall += t
            while (r := rng.expovariate(1 / job_mttf)) < 720:
                wall += r
            wall += 720
        wall += g.interval_s + 60
    assert g.wall_s == pytest.approx(wall, rel=0.01)
    assert g.interruptions == pytest.approx(g.wall_s / job_mttf)
    # 54 days of wall-clock at Llama 3's rate: its 466 interruptions
    days54 = goodput(LLAMA3_DAYS * 86400 * g.work_s / g.wall_s, 16384, 0, save_s=60, load_s=120, restart_s=600)
    assert days54.wall_s == pytest.approx(LLAMA3_DAYS * 86400) and days54.interruptions == pytest.approx(466)


def test_plan_reports_days_and_gpu_hours_with_failures(capsys):
    args = ["--model", "llama3_8b", "--gpus", "64", "--layout", "dp_shard=64,zero_stage=3,ac=full", "--json",
            "--mttf-hours", "6400", "--checkpoint-save-s", "30", "--checkpoint-load-s", "90", "--restart-s", "300"]
    assert plan_main(args) == 0
    row = json.loads(capsys.readouterr().out.splitlines()[0])
    g = row["goodput"]
    assert g["job_mttf_hours"] == pytest.approx(100) and g["restart_s"] == 300
    assert g["checkpoint_interval_s"] == pytest.approx(math.sqrt(2 * 30 * 100 * 3600))
    assert row["training_days_with_failures"] == pytest.approx(row["training_days"] / g["goodput"])
    assert row["gpu_hours_with_failures"] == pytest.approx(row["training_days_with_failures"] * 24 * 64)
    assert row["training_days_with_failures"] > row["training_days"]


# ---- 5. nothing fits or divides ------------------------------------------------------------------
def test_nearest_gpu_counts_and_batches_when_nothing_divides(capsys):
    spec, _ = load_model_spec("llama3_70b")
    cl, w = Cluster(get_accelerator("H100"), 1000), Workload(8192, 1024 * 8192)
    assert search(spec, cl, w) == []
    gpus = nearest_gpus(spec, cl, w, tries=3)
    assert gpus and all(abs(g - 1000) <= 24 and search(spec, replace(cl, gpus=g), w, top=1) for g in gpus)
    batches = nearest_batches(spec, cl, w, want=1, tries=4)
    assert batches and search(spec, cl, replace(w, global_batch_tokens=batches[0] * 8192), top=1)
    assert abs(batches[0] - 1024) <= 8


def test_nvlink_domain_alignment_warnings():
    nvl = get_accelerator("GB200")
    assert alignment_warnings(Cluster(nvl, 256)) == [
        "256 GPUs is not a multiple of the 72-GPU NVLink domain: 3 full domains and 40 GPUs in a partial one"]
    assert alignment_warnings(Cluster(nvl, 288), parse_layout("tp=16,dp_shard=18")) == [
        ("tp x cp = 16 does not divide the 72-GPU NVLink domain: some of its groups straddle two domains "
         "and cross the NIC (modelled as inside one)")]
    assert alignment_warnings(Cluster(get_accelerator("H100"), 512), parse_layout("tp=8,dp_shard=64")) == []


@pytest.mark.parametrize("flag, value, want", [
    ("--mttf-hours", "-5", "argument --mttf-hours: -5 must be a number > 0"),
    ("--mttf-hours", "0", "argument --mttf-hours: 0 must be a number > 0"),
    ("--checkpoint-save-s", "-1", "argument --checkpoint-save-s: -1 must be a number > 0"),
    ("--restart-s", "nan", "argument --restart-s: nan must be a number >= 0"),
    ("--mttf-hours", "1e-9", "the run would never finish")])
def test_goodput_flags_out_of_range_are_one_line_errors(flag, value, want, capsys):
    """Exit 2 and a line naming the flag (argparse) or the unbounded expected time (an MTTF far below
    one checkpoint interval), never a math-domain or overflow traceback."""
    from ndtrain.cli.commands import main

    try:
        rc = main(["plan", "--model", "llama3_8b", "--hardware", "H100", "--gpus", "64", flag, value])
    except SystemExit as e:  # argparse's own exit
        rc = e.code
    assert rc == 2 and want in capsys.readouterr().err
