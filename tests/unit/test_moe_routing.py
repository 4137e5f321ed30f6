"""Forced-balanced MoE routing (``training.moe_routing: balanced``) and the MoE load figures.

The assignment is round-robin by position in the whole sequence (``balanced_assignment``): exact equal
counts per expert and per ep rank when E divides T k, distinct experts per token, and the same
experts on every cp shard as in the whole sequence. A one-process run reports exactly equal loads
and says ``moe_routing: balanced`` at start-up and in every metrics row (JSONL and console)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ndtrain.config import ConfigError, load_config
from ndtrain.data import prepare_data
from ndtrain.mesh import ParallelDims
from ndtrain.model.moe_capacity import SequenceShards, balanced_assignment
from ndtrain.parallel.cp.context_parallel import chunk_ids, local_positions
from ndtrain.train.loop import run
from ndtrain.train.metrics import format_line, read_metrics
from ndtrain.train.trainer import Trainer
from tests.corpus import source_text
from tests.utils import tiny_config


@pytest.mark.parametrize("b,t,k,e", [(2, 16, 2, 8), (3, 12, 3, 6), (1, 8, 1, 8), (2, 10, 4, 5)])
def test_balanced_assignment_gives_exactly_equal_counts(b, t, k, e):
    idx = balanced_assignment((b, t), k, e)
    assert idx.shape == (b * t, k) and idx.dtype == torch.int64
    assert all(len(set(row)) == k for row in idx.tolist())  # a token's k experts are distinct
    counts = torch.bincount(idx.reshape(-1), minlength=e)
    assert counts.tolist() == [b * t * k // e] * e  # E divides T k in every case above
    for ep in (d for d in (2, 4) if e % d == 0):
        assert counts.view(ep, e // ep).sum(1).tolist() == [b * t * k // ep] * ep


def test_balanced_assignment_is_uneven_only_by_the_remainder_when_e_does_not_divide_tk():
    counts = torch.bincount(balanced_assignment((1, 5), 2, 4).reshape(-1), minlength=4)
    assert counts.tolist() == [3, 3, 2, 2]  # 10 assignments round-robin over 4 experts


@pytest.mark.parametrize("cp,layout", [(2, "load_balanced"), (4, "load_balanced"), (2, "contiguous")])
def test_balanced_assignment_on_cp_shards_equals_the_whole_sequence(cp, layout):
    b, t, k, e = 2, 24, 2, 8  # chunks of 6 or 3: not multiples of the period E / k, so a shard must
    whole = balanced_assignment((b, t), k, e).view(b, t, k)
    chunks = tuple(chunk_ids(cp, r, layout) for r in range(cp))  # know where its chunks start
    for r in range(cp):
        shards = SequenceShards(r, chunks, lambda x: x, lambda x: x)
        got = balanced_assignment((b, t // cp), k, e, shards).view(b, t // cp, k)
        assert torch.equal(got, whole[:, local_positions(t, cp, r, layout)]), (cp, layout, r)


def test_moe_routing_key_is_checked():
    with pytest.raises(ConfigError, match=r"^training.moe_routing \(even\) must be learned\|balanced$"):
        tiny_config({"training.moe_routing": "even"}, world=1, preset="moe_debug")
    with pytest.raises(ConfigError, match=r"^training.moe_routing=balanced needs an MoE model \(model.moe_experts > 0\)$"):
        tiny_config({"training.moe_routing": "balanced"}, world=1)  # the dense debug preset


def _steps(routing: str) -> list[dict]:
    torch.manual_seed(0)
    cfg = tiny_config({"training.moe_routing": routing, "training.global_batch_size": 4,
                       "training.micro_batch_size": 2}, world=1, preset="moe_debug")
    tr = Trainer(cfg, ParallelDims(world_size=1).build_mesh(), torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    outs = []
    for _ in range(3):
        x = torch.randint(0, cfg.model.vocab_size, (4, cfg.data.seq_len), generator=g)
        outs.append(tr.step(x, torch.roll(x, -1, 1)))
    return outs


def test_one_process_balanced_loads_are_exactly_equal_and_learned_ones_are_not():
    bal, learned = _steps("balanced"), _steps("learned")
    mean = 4 * 16 * 2 / 8  # B T k / E with the tiny T 16, moe_debug's E 8, k 2
    for o in bal:
        assert o["moe_routing"] == "balanced"
        assert o["moe_tokens_per_expert_max"] == o["moe_tokens_per_expert_mean"] == mean
        assert o["moe_tokens_per_ep_rank_max"] == o["moe_tokens_per_ep_rank_mean"] == mean * 8  # ep 1: all
        assert o["moe_load_max_mean"] == o["moe_load_max_mean_worst"] == 1.0
        assert o["moe_dropped_frac"] == 0.0
        assert o["moe_peak_mem_bytes_max"] > 0
    assert all(o["moe_routing"] == "learned" for o in learned)
    assert max(o["moe_tokens_per_expert_max"] for o in learned) > mean  # the learned router is skewed
    assert bal[0]["loss"] != learned[0]["loss"]


def test_balanced_run_is_marked_at_start_and_in_every_row(tmp_path: Path, capsys):
    torch.set_num_threads(1)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(source_text(20000))
    over = {"data.source": str(corpus), "data.tokenizer": "bytes", "data.cache_dir": str(tmp_path / "cache"),
            "training.steps": 3, "logging.log_every": 1, "training.eval_every": 0, "checkpoint.every": 0,
            "training.sample_tokens": 0, "training.global_batch_size": 4, "training.micro_batch_size": 2,
            "data.seq_len": 16, "training.moe_routing": "balanced"}
    cfg = load_config("moe_debug", over, world_size=1)
    run(cfg, tmp_path / "run", prepare_data(cfg.data, cfg.model.vocab_size))
    out = capsys.readouterr().out
    assert out.count("moe_routing: balanced -- FORCED round-robin expert routing") == 1
    rows = [r for r in read_metrics(tmp_path / "run") if "loss" in r and r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["moe_routing"] == "balanced" and r["moe_load_max_mean"] == 1.0
        assert format_line(r).count("moe_routing: balanced | load max/mean 1.00") == 1
    assert out.count("moe_routing: balanced | load max/mean 1.00") == 3  # every echoed row
