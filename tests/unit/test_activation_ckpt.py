"""Activation checkpointing, the dim-0 flat-shard layout and the memory meter (single process).

References: the un-checkpointed model (recompute replays the same float64 ops in the same order on
CPU, so losses and weights must be *bitwise* equal), torch.chunk (shard rows), the slow twin
``pack_reference`` (``pack``), and closed-form byte counts for the meter.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ndtrain.config import Config, ModelConfig
from ndtrain.mem_account import ActivationMeter, StateMemory, storage_bytes
from ndtrain.mesh import ParallelDims
from ndtrain.model import build_model
from ndtrain.parallel.activation_ckpt import apply_activation_checkpoint, parse_policy
from ndtrain.parallel.zero.flat_shard import FlatShardLayout
from ndtrain.train.loop import Trainer
from tests.utils import tiny_config


def test_parse_policy():
    assert parse_policy("none", 16) == ("none", 0)
    assert parse_policy("full", 16) == ("segment", 1)
    assert parse_policy("every:3", 16) == ("segment", 3)
    assert parse_policy("sqrt", 16) == ("segment", 4) and parse_policy("sqrt", 2) == ("segment", 1)
    assert parse_policy("selective", 16) == ("selective", 1)
    with pytest.raises(ValueError, match="every:C"):
        parse_policy("every:0", 4)


def test_one_policy_parser_for_validation_and_planner():
    """Validation (``parallel.rules``) and the planner (``ac_every``) read the policy through the
    same parser as the mechanism: same accepted strings, same C."""
    from ndtrain.config import ConfigError
    from ndtrain.parallel.ac_policy import every_blocks, is_valid_policy
    from ndtrain.parallel.rules import check_activation_checkpoint
    from ndtrain.planner.layout import ac_every

    for ac in ("none", "full", "sqrt", "selective", "every:1", "every:7"):
        assert is_valid_policy(ac)
        check_activation_checkpoint(ac)
    for ac in ("every:0", "every:", "every:-2", "sqrt:2", "Full", ""):
        assert not is_valid_policy(ac)
        with pytest.raises(ConfigError, match="every:C"):
            check_activation_checkpoint(ac)
    assert [ac_every(a, 16) for a in ("none", "full", "selective", "every:3", "sqrt")] == [0, 0, 0, 3, 4]
    assert every_blocks("sqrt", 2) == 1 and every_blocks("every:1", 8) == 1


def _cfg(ac: str) -> Config:
    return tiny_config({"model.dim": 30, "model.n_layers": 4, "model.n_heads": 3, "model.n_kv_heads": 1,
                        "model.ffn_hidden": 45, "data.seq_len": 256, "training.micro_batch_size": 2,
                        "training.warmup_steps": 1, "training.activation_checkpoint": ac, "training.steps": 100,
                        "training.grad_clip": 1.0, "parallel.bucket_size_bytes": 25 * 2**20})


def test_every_policy_gives_identical_losses_and_weights():
    runs = {}
    for ac in ("none", "full", "every:2", "sqrt", "every:3", "selective"):
        tr = Trainer(_cfg(ac), ParallelDims().build_mesh(), torch.device("cpu"))
        losses = []
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randint(0, 61, (4, 12), generator=g), torch.randint(0, 61, (4, 12), generator=g)
            out = tr.step(x, y)
            losses.append((out["loss"], out["grad_norm"]))
        runs[ac] = (losses, {k: v.clone() for k, v in tr.model.state_dict().items()})
    base_losses, base_params = runs.pop("none")
    for ac, (losses, params) in runs.items():
        assert losses == base_losses, ac
        assert all(torch.equal(params[k], base_params[k]) for k in base_params), ac


class _DropBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d, dtype=torch.float64)

    def forward(self, x, cos, sin, kv_cache=None):
        return x + F.dropout(torch.tanh(self.lin(x)), p=0.5, training=True)


class _DropModel(nn.Module):
    def __init__(self, n: int, d: int = 8):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): _DropBlock(d) for i in range(n)})

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x, None, None, None)
        return x


@pytest.mark.parametrize("policy", ["full", "every:2", "selective"])
def test_recompute_restores_rng_so_dropout_masks_match(policy):
    x = torch.randn(3, 8, dtype=torch.float64)
    grads = []
    for ac in ("none", policy):
        torch.manual_seed(0)
        model = _DropModel(4)
        if ac != "none":
            apply_activation_checkpoint(model, ac)
        torch.manual_seed(123)
        model(x).pow(2).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_checkpointing_keeps_O_L_or_O_sqrt_L_block_inputs():
    """Bytes kept between forward and backward: full keeps one block input per block, sqrt (C=4
    for L=16) one per segment, so full - sqrt = (16 - 4) block inputs of B*T*C*8 bytes exactly."""
    kept = {}
    for ac in ("none", "full", "sqrt"):
        model = build_model(ModelConfig(vocab_size=32, dim=16, n_layers=16, n_heads=2, ffn_hidden=24,
                                        max_seq_len=32, rope_theta=1e4), "cpu", torch.float64)
        apply_activation_checkpoint(model, ac)
        x = torch.randint(0, 32, (2, 8))
        with ActivationMeter(model.parameters()) as meter:
            loss = model(x).sum()
            kept[ac] = meter.current
            loss.backward()
            del loss
        assert meter.current == 0 and meter.peak >= kept[ac]  # everything freed after backward
    block_input = 2 * 8 * 16 * 8
    assert kept["full"] - kept["sqrt"] == 12 * block_input
    assert kept["none"] > 4 * kept["full"]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_flat_shard_layout_matches_chunk_and_slow_twin(n):
    g = torch.Generator().manual_seed(n)
    shapes = [(5, 2), (3,), (7, 3, 2), (1, 4), (8, 1)]
    fulls = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    grid, packed_ref = None, None
    for rank in range(n):
        lay = FlatShardLayout([torch.Size(s) for s in shapes], n, rank)
        if grid is None:
            grid = lay.pack(fulls, torch.empty(lay.padded_numel, dtype=torch.float64))
            packed_ref = lay.pack_reference(fulls, torch.full((lay.padded_numel,), 7.0, dtype=torch.float64))
            assert torch.equal(grid, packed_ref)
            cast = lay.pack([f.float() for f in fulls], torch.empty(lay.padded_numel, dtype=torch.float64))
            assert torch.equal(cast, lay.pack([f.float().double() for f in fulls], torch.empty_like(cast)))
            outs = [torch.empty(s, dtype=torch.float64) for s in shapes]
            lay.unpack(grid, outs)
            assert all(torch.equal(a, b) for a, b in zip(outs, fulls))
        shard = lay.shard_from_full(fulls, torch.empty(lay.shard_numel, dtype=torch.float64))
        assert torch.equal(shard, grid.view(n, -1)[rank])  # a rank's shard is its row of the gather
        for i, full in enumerate(fulls):
            chunks = torch.chunk(full, n)
            want = chunks[rank] if rank < len(chunks) else full[:0]
            assert torch.equal(lay.valid_view(shard, i), want)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_flat_shard_layout_empty_scalar_and_tiny(n):
    """(0,) and (3, 0) take no space, a 0-d parameter is one row of one element, (1,) and (2, 3)
    have fewer rows than ranks: pack equals its slow twin (which fills padding with zeros over a
    7.0 canvas) and each rank's valid rows are its ``torch.chunk`` (of the 0-d one seen as (1,))."""
    g = torch.Generator().manual_seed(n)
    shapes = [(0,), (), (1,), (2, 3), (3, 0), (5,)]
    fulls = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    lay0 = FlatShardLayout([torch.Size(s) for s in shapes], n, 0)
    assert lay0.sizes[0] == lay0.sizes[4] == 0 and lay0.sizes[1] == 1
    grid = lay0.pack(fulls, torch.empty(lay0.padded_numel, dtype=torch.float64))
    assert torch.equal(grid, lay0.pack_reference(fulls, torch.full_like(grid, 7.0)))
    outs = [torch.full(s, 7.0, dtype=torch.float64) for s in shapes]
    lay0.unpack(grid, outs)
    assert all(torch.equal(a, b) for a, b in zip(outs, fulls))
    for rank in range(n):
        lay = FlatShardLayout([torch.Size(s) for s in shapes], n, rank)
        shard = lay.shard_from_full(fulls, torch.empty(lay.shard_numel, dtype=torch.float64))
        assert torch.equal(shard, grid.view(n, -1)[rank])
        for i, full in enumerate(fulls):
            rows = full.reshape(1) if full.dim() == 0 else full
            chunks = torch.chunk(rows, n) if rows.shape[0] else ()
            want = chunks[rank] if rank < len(chunks) else rows[:0]
            assert torch.equal(lay.valid_view(shard, i), want), (n, rank, shapes[i])


def test_storage_bytes_counts_each_storage_once():
    a = torch.zeros(10, dtype=torch.float64)
    b = torch.zeros(3, dtype=torch.float32)
    assert storage_bytes([a, a[2:5], a.view(2, 5), b, None]) == 80 + 12
    mem = StateMemory()
    mem.sample({"params": [a], "grads": [b]})
    mem.sample({"params": [a], "grads": []})
    assert mem.report()["mem_state_peak_bytes"] == 92 and mem.report()["mem_grads_bytes"] == 12
