"""The planner's trainer accounting of one block under each token mixer (``planner.trainer_mixers``)
and each per-layer checkpointing policy (``planner.trainer_mixer_ac``) against what the trainer
really keeps, rehearsed: a bf16 ZeRO-1 model whose every layer is the mixer, 2 and 4 blocks, the
difference over 2 blocks is one block's saved bytes at the forward peak (the loss, embedding and
state cancel; ``test_ac_accounting``'s method). Mixer-only blocks (``model.block_ffn`` false), so
the whole difference is the mixer half.

Under the policies, one hybrid of every mixer (``HYBRID``): its blocks once and twice differ by one
block of each mixer, whatever the policy puts the peak at (the end of the forward, or the
recompute of the last block in backward: the same block of the second copy). The trainer accepts
every policy with every mixer.
"""
from __future__ import annotations

import functools

import pytest

from ndtrain.config import load_config
from ndtrain.planner.model_spec import from_model_config
from ndtrain.planner.trainer_ac import POLICY_NAMES
from ndtrain.planner.trainer_memory import trainer_layer_bytes
from ndtrain.rehearsal.roles import rank_roles
from ndtrain.rehearsal.run import run_role

SEQ, MICRO = 256, 4
BASE = {"model.dim": 128, "model.n_heads": 4, "model.n_kv_heads": 2, "model.block_ffn": False,
        "model.max_seq_len": SEQ, "data.seq_len": SEQ, "training.dtype": "bfloat16", "parallel.zero_stage": 1,
        "training.global_batch_size": 8 * MICRO, "training.micro_batch_size": MICRO,
        "model.linear_chunk_size": 64}
WORLD = 8  # dp8 (x tp): the optimizer state sharded, so it never sets the peak

MIXERS = {  # letter, fields of the mixer
    "gated_deltanet": ("G", {"model.linear_heads": 2, "model.linear_key_head_dim": 32, "model.linear_value_heads": 4,
                             "model.linear_value_head_dim": 32}),
    "mamba2": ("M", {"model.mamba_head_dim": 32, "model.mamba_state_dim": 16, "model.mamba_groups": 2}),
    "linear": ("L", {}),
    "sliding_window": ("S", {"model.swa_window": 64}),
    "dsa": ("D", {"model.dsa_top_k": 32, "model.dsa_index_heads": 4}),
}


def _activations(over: dict, world: int, n_layers: int) -> tuple[int, object]:
    over = {**over, "model.n_layers": n_layers}
    cfg = load_config("debug", over, world_size=world)
    (role,) = rank_roles(cfg, world)
    return run_role("debug", over, world, role)["memory_peak"]["activations"], cfg


def _check(mixer: str, tp: int) -> None:
    letter, fields = MIXERS[mixer]
    over = {**BASE, **fields, "model.layer_pattern": letter}
    if tp > 1:
        over.update({"parallel.tp": tp, "parallel.sequence_parallel": True})
    two, cfg = _activations(over, WORLD * tp, 2)
    four, _ = _activations(over, WORLD * tp, 4)
    rehearsed = (four - two) / 2
    spec = from_model_config(cfg.model)
    kw = {"tp": tp, "sp": tp > 1, "kind": "lowp", "e": 2, "chunk": cfg.model.linear_chunk_size}
    want = trainer_layer_bytes(spec, MICRO * SEQ, SEQ, mixer=mixer, **kw)["total"]
    # reference: the rehearsed trainer (MemTracker at the forward peak), to the byte
    assert want == rehearsed, (mixer, tp, want, rehearsed)
    # and the check tells the mixers apart: softmax attention's bytes would miss by more
    softmax = trainer_layer_bytes(spec, MICRO * SEQ, SEQ, mixer="attention", **kw)["total"]
    assert softmax != pytest.approx(rehearsed, rel=0.02), (mixer, tp, softmax, rehearsed)


HYBRID = "".join(letter for letter, _ in MIXERS.values())  # "GMLSD": one block of each mixer
HYBRID_FIELDS = {k: v for _, fields in MIXERS.values() for k, v in fields.items()}


@functools.cache
def _hybrid_activations(policy: str, pattern: str, n_layers: int) -> int:
    """Rehearsed activations at the peak of a ``pattern`` hybrid (repeated over ``n_layers``) under
    ``policy``; cached, so the tests share their runs. No warm-up step: the optimizer state it
    creates is not an activation, and the peak's activations come out the same without it."""
    over = {**BASE, **HYBRID_FIELDS, "model.layer_pattern": pattern, "model.n_layers": n_layers,
            "training.activation_checkpoint": policy}
    cfg = load_config("debug", over, world_size=WORLD)
    (role,) = rank_roles(cfg, WORLD)
    return run_role("debug", over, WORLD, role, warmup=0)["memory_peak"]["activations"]


def _planned(policy: str, mixer: str) -> float:
    """The planner's bytes of one hybrid block of ``mixer`` under ``policy``."""
    cfg = load_config("debug", {**BASE, **HYBRID_FIELDS, "model.layer_pattern": HYBRID, "model.n_layers": len(HYBRID)},
                      world_size=WORLD)
    kw = {"tp": 1, "sp": False, "kind": "lowp", "e": 2, "chunk": cfg.model.linear_chunk_size, "policy": policy}
    return trainer_layer_bytes(from_model_config(cfg.model), MICRO * SEQ, SEQ, mixer=mixer, **kw)["total"]


def _check_hybrid(policy: str) -> None:
    """One block of each mixer: the hybrid twice minus once equals the planner's five blocks."""
    n = len(HYBRID)
    rehearsed = _hybrid_activations(policy, HYBRID, 2 * n) - _hybrid_activations(policy, HYBRID, n)
    want = sum(_planned(policy, m) for m in MIXERS)
    assert want == rehearsed, (policy, want, rehearsed, {m: _planned(policy, m) for m in MIXERS})
    # and the check tells the policy's figure from the mixer halves kept whole (as under none)
    assert sum(_planned("none", m) for m in MIXERS) != rehearsed, policy


@pytest.mark.parametrize("policy", ["op", "deepseek"])
def test_hybrid_blocks_under_op_and_deepseek_equal_the_rehearsal(policy):
    """op: every projection's and chunk matmul's output (the window's kernel output too);
    deepseek: the block norm's input and the gated norms' two inputs in place of their internals."""
    _check_hybrid(policy)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["selective", "core_attn"])
def test_hybrid_blocks_under_selective_and_core_attn_equal_the_rehearsal(policy):
    """selective: op less the window kernel's output and log-sum-exp; core_attn: only the window's
    core is checkpointed (the linear mixers have no core, DSA's forward calls none)."""
    _check_hybrid(policy)


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_each_mixer_block_under_each_policy_equals_the_rehearsal(policy):
    """Each mixer apart: one more block of it before the hybrid adds the planner's bytes of that
    block (the hybrid already holds one, so the peak stays at the same block)."""
    n = len(HYBRID)
    base = _hybrid_activations(policy, HYBRID, n)
    for mixer, (letter, _) in MIXERS.items():
        rehearsed = _hybrid_activations(policy, letter + HYBRID, n + 1) - base
        assert _planned(policy, mixer) == rehearsed, (policy, mixer, _planned(policy, mixer), rehearsed)


def test_sliding_window_block_bytes_equal_the_rehearsal():
    """The window mask, as SDPA's additive mask in bf16 (2w per token), is what softmax lacks."""
    _check("sliding_window", 1)


@pytest.mark.slow
@pytest.mark.parametrize("mixer", ["gated_deltanet", "mamba2", "linear"])
def test_chunked_mixer_block_bytes_equal_the_rehearsal(mixer):
    """The chunked kernels under bf16 autocast: fp32 chunk tensors plus each matmul's bf16 casts."""
    _check(mixer, 1)


@pytest.mark.slow
def test_dsa_block_bytes_equal_the_rehearsal():
    """The indexer's T-wide scores per indexer head and the gathered top-k keys and values."""
    _check("dsa", 1)


@pytest.mark.slow
def test_gated_deltanet_block_bytes_under_tp2_sp_equal_the_rehearsal():
    """Key and value heads split over tp (the fused projections by key-head group), the norm's
    tokens over SP."""
    _check("gated_deltanet", 2)


def test_a_stage_sums_its_blocks_each_under_its_own_mixer():
    """A Qwen3-Next-like GGGA stage (no rehearsal): its activations are three Gated DeltaNet blocks
    and one attention block, from the block indices or, without them, the pattern's shares."""
    from types import SimpleNamespace

    from ndtrain.planner.layout import Layout
    from ndtrain.planner.trainer_memory import stage_mixer_counts, trainer_rank_breakdown

    # linear_chunk_size at its default: the planner's MixerFields does not carry it
    cfg = load_config("hybrid_debug", {"training.dtype": "bfloat16", "model.linear_chunk_size": 64}, world_size=1)
    spec = from_model_config(cfg.model)
    assert stage_mixer_counts(spec, 2, (2, 3)) == {"gated_deltanet": 1, "attention": 1}
    assert stage_mixer_counts(spec, 4) == {"gated_deltanet": 3.0, "attention": 1.0}
    w = SimpleNamespace(precision="fp32", act_bytes=2, seq_len=32, fused_loss=False)
    lay = Layout(zero_stage=1, dp_shard=1, ac="none")
    prm = {"dense": 0, "expert": 0}
    kw = {"tokens": 64, "seq_len": 32, "kind": "lowp", "e": 2, "moe": True}
    want = 3 * trainer_layer_bytes(spec, mixer="gated_deltanet", **kw)["total"] + trainer_layer_bytes(spec, **kw)["total"]
    for layers in ((0, 1, 2, 3), None):
        got = trainer_rank_breakdown(spec, w, lay, prm, 4, 4, False, 1, 1, 64, layers=layers)["activations"]
        assert got == pytest.approx(want), layers
    every_attention = 4 * trainer_layer_bytes(spec, **kw)["total"]
    assert want > 1.5 * every_attention  # what the accounting gave before it knew the mixers
