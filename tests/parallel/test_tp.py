"""Tensor parallel (+ sequence parallel) against the single-process oracle.

Reference: the same ``Trainer`` with a world-size-1 layout on the whole global batch
(``tests/parallel/layout_parity.py``). 10 float64 steps, clipping active, vocabulary 61 (padded to
62 / 64), GQA with 2 kv heads (split over tp=2, replicated over tp=4). Tolerance 1e-6 relative:
the layouts only reorder float64 sums (split matmuls, all-reduces), which stays near 1e-13.
Communication is checked exactly against ``theory_bytes``.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ndtrain.checkpoint import dcp as ckpt
from ndtrain.config import ConfigError, ParallelConfig
from ndtrain.mesh import AxisGroup, ParallelDims
from ndtrain.model import build_model
from ndtrain.parallel.tp.rules import check_heads as check_tp_heads
from ndtrain.parallel.tp.tensor_parallel import apply_tp, padded_vocab
from ndtrain.parallel.tp.vocab_loss import vocab_parallel_cross_entropy
from ndtrain.train.loop import Trainer
from tests.dist_utils import run_ranks
from tests.parallel.layout_parity import V, assert_bytes, assert_parity, global_batch, run_layout, tiny_cfg
from tests.parallel.sp_saved import sp_saved_check


def _ce_inputs(n: int = 24, vp: int = 64):
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(n, vp, dtype=torch.float64, generator=g) * 3
    labels = torch.randint(0, V, (n,), generator=g)
    labels[::5] = -100
    return logits, labels


def test_vocab_parallel_ce_one_rank_with_padding():
    """Size-1 group: equals F.cross_entropy over the first V columns; padded columns (V..Vp) get no
    probability and zero gradient even though their raw logits are large."""
    logits, labels = _ce_inputs()
    logits[:, V:] = 50.0
    x = logits.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(x, labels, AxisGroup("tp", 1, 0, None), V)
    ref_x = logits[:, :V].clone().requires_grad_()
    ref = F.cross_entropy(ref_x, labels, ignore_index=-100, reduction="none")
    assert (loss - ref).abs().max() < 1e-12
    loss.sum().backward()
    ref.sum().backward()
    assert (x.grad[:, :V] - ref_x.grad).abs().max() < 1e-12
    assert x.grad[:, V:].abs().max() == 0
    assert loss[::5].abs().max() == 0


@pytest.mark.parametrize("over,match", [
    ({"parallel.tp": 3}, r"n_heads \(4\) is not divisible by tp \(3\)"),
    ({"parallel.sequence_parallel": True}, r"sequence_parallel needs tp > 1"),
    ({"parallel.tp": 2, "parallel.sequence_parallel": True, "data.seq_len": 15},
     r"tokens per cp rank .* not divisible by tp \(2\)"),
    ({"model.n_heads": 6, "model.dim": 48, "model.n_kv_heads": 3, "parallel.tp": 2},
     r"n_kv_heads \(3\) and tp \(2\): one must divide the other"),
])
def test_config_rejects_bad_tp_layouts(over, match):
    from ndtrain.config import apply_overrides, validate

    cfg = tiny_cfg()
    apply_overrides(cfg, over)
    with pytest.raises(ConfigError, match=match):
        validate(cfg)


def test_gqa_rule_and_padding():
    check_tp_heads(8, 2, 4)  # replicate: tp % G == 0
    check_tp_heads(8, 4, 2)  # split: G % tp == 0
    with pytest.raises(ValueError, match=r"n_kv_heads \(3\) and tp \(2\)"):
        check_tp_heads(6, 3, 2)
    assert padded_vocab(61, 4) == 64 and padded_vocab(64, 4) == 64


class FakeMesh:
    """The parts of a ``Mesh`` the ``apply_<axis>`` functions read while installing their modules
    (group sizes and this rank's place; no process group: nothing here may communicate)."""

    def __init__(self, rank: int, **sizes: int):
        self.rank, self.sizes = rank, sizes
        self.dims = SimpleNamespace(dp_cp=1, **sizes)

    def group(self, name: str) -> AxisGroup:
        n = self.sizes.get(name, 1)
        return AxisGroup(name, n, self.rank if n > 1 else 0, None)


def test_repr_shows_the_tp_layout_and_names_do_not_change():
    """After ``apply_tp`` every layer prints its sharding (plan table -> wrapper modules), and the
    parameter names / state-dict keys are exactly the single-device model's."""
    cfg = tiny_cfg()
    model = build_model(cfg.model, "cpu", torch.float64, 0)
    keys = list(model.state_dict())
    apply_tp(model, FakeMesh(1, tp=2), sequence_parallel=True)
    text = repr(model)
    for line in ("(tok_embeddings): VocabParallelEmbedding(rows=62/tp2 [31, 62), vocab=61, dim=32, sp=True)",
                 "(attention_norm): SequenceParallelNorm(RMSNorm(32, eps=1e-05), weight grad: all-reduce over tp2)",
                 "(wq): ColumnParallelLinear(in=32, out=32/tp2, sp=True)",
                 "(wk): ColumnParallelLinear(in=32, out=16/tp2, sp=True)",
                 "(wo): RowParallelLinear(in=32/tp2, out=32, sp=True, output: reduce-scatter T)",
                 "(w2): RowParallelLinear(in=48/tp2, out=32, sp=True, output: reduce-scatter T)",
                 "(tp_input): RegionInput(tp=2, all-gather T)",
                 "(norm): SequenceParallelNorm(RMSNorm(32, eps=1e-05), weight grad: all-reduce over tp2)",
                 "(output): ColumnParallelLinear(in=32, out=62/tp2 (padded from 61), sp=True, input: all-gather T)"):
        assert line in text, (line, text)
    assert "Linear(in_features" not in text and "): Embedding(" not in text
    assert list(model.state_dict()) == keys
    assert tuple(model.layers["0"].attention.wq.weight.shape) == (16, 32)

    model = build_model(tiny_cfg().model, "cpu", torch.float64, 0)  # tp=4 > 2 kv heads: replicated
    full_wk = model.layers["1"].attention.wk.weight.detach().clone()
    apply_tp(model, FakeMesh(2, tp=4))
    text = repr(model)
    assert ("(wk): ReplicatedKVLinear(in=32, out=8 (kv head 1 of 2, whole weight), grad: all-reduce over tp4)"
            in text), text
    assert "(wo): RowParallelLinear(in=32/tp4, out=32, sp=False, output: all-reduce)" in text
    assert "(tp_input): RegionInput(tp=4, copy (bwd all-reduce))" in text
    assert "(attention_norm): RMSNorm(32, eps=1e-05)" in text  # replicated, untouched without SP
    assert torch.equal(model.layers["1"].attention.wk.weight, full_wk)
    assert list(model.state_dict()) == keys


def _local_batch(trainer: Trainer, step: int):
    dp = trainer.mesh.group("dp")
    inputs, labels = global_batch(step)
    n = inputs.shape[0] // dp.size
    return inputs[dp.rank * n:(dp.rank + 1) * n], labels[dp.rank * n:(dp.rank + 1) * n]


def _checkpoint_roundtrip(tr: Trainer, cfg, mesh, ckpt_dir: str) -> dict:
    """Save a trainer after 3 steps, load the checkpoint into a single-process trainer and a fresh
    trainer of the same layout, and take step 4 on all three: the losses must agree (weights, AdamW
    moments and LR schedule restored; saved tensors have global, unpadded shapes)."""
    state = tr.tensor_state()
    shapes = tuple(tuple(x.shape) for x in (state["model"]["output.weight"],
                                             state["optim"]["state"]["layers.0.attention.wq.weight"]["exp_avg"]))
    ckpt.save_checkpoint(Path(ckpt_dir), 3, state, {"scheduler": tr.scheduler.state_dict()})
    path = ckpt.latest_checkpoint(Path(ckpt_dir))
    losses = [tr.step(*_local_batch(tr, 3))["loss"]]
    for t_cfg, t_mesh in ((tiny_cfg(1), ParallelDims(world_size=1).build_mesh()), (cfg, mesh)):
        other = Trainer(t_cfg, t_mesh, torch.device("cpu"))
        st = other.tensor_state()
        meta = ckpt.load_checkpoint(path, st)
        other.load_tensor_state(st)
        other.scheduler.load_state_dict(meta["scheduler"])
        losses.append(other.step(*_local_batch(other, 3))["loss"])
    return {"ckpt_shapes": shapes, "ckpt_loss": max(abs(x - losses[0]) / losses[0] for x in losses)}


def _world2(rank: int, world: int, ckpt_dir: str) -> dict:
    out = {"tp": run_layout(rank, world, tp=2),
           "sp": run_layout(rank, world, tp=2, sequence_parallel=True),
           "tied_micro": run_layout(rank, world, tie=True, micro=2, tp=2, sequence_parallel=True)}
    # With SP the norm gains are replicated but used on different tokens: after 3 steps they must
    # be bit-identical over tp (their gradients are summed over tp before the update).
    cfg = tiny_cfg(world, tp=2, sequence_parallel=True)
    mesh = ParallelDims.from_config(cfg.parallel, world).build_mesh()
    tr = Trainer(cfg, mesh, torch.device("cpu"))
    for step in range(3):
        tr.step(*_local_batch(tr, step))
    norms = torch.cat([p.detach().reshape(-1) for n, p in tr.model.named_parameters() if "norm" in n])
    gathered = [torch.empty_like(norms) for _ in range(world)]
    dist.all_gather(gathered, norms)
    out["norm_spread"] = (gathered[0] - gathered[1]).abs().max().item()
    out["norm_moved"] = (norms - 1).abs().max().item()
    out["pad_rows"] = tr.model.output.weight[V - 31 * rank:].abs().max().item() if rank == 1 else 0.0
    out.update(_checkpoint_roundtrip(tr, cfg, mesh, ckpt_dir))
    # Vocab-parallel CE over gloo vs F.cross_entropy on the gathered, unpadded logits.
    logits, labels = _ce_inputs(vp=padded_vocab(V, world))
    x = logits.chunk(world, dim=1)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(x, labels, mesh.group("tp"), V)
    loss.sum().backward()
    ref_x = logits[:, :V].clone().requires_grad_()
    ref = F.cross_entropy(ref_x, labels, ignore_index=-100, reduction="none")
    ref.sum().backward()
    ref_grad = F.pad(ref_x.grad, (0, logits.shape[1] - V)).chunk(world, dim=1)[rank]
    out["ce"] = max((loss - ref).abs().max().item(), (x.grad - ref_grad).abs().max().item())
    out["sp_saved"] = sp_saved_check(rank, world)
    return out


def _assert_sp_saves_shards(r: dict) -> None:
    """The reference path saves, per column-parallel linear, a contiguous copy of the gathered
    (B, T, C) input (F.linear flattens the T-major gather); the shard path saves one (B, T/tp, C)
    shard per region (attention, MLP, head) and all-gathers it once more per region in backward."""
    (n_layers, b, t, c, tp), e = r["dims"], 8  # float64
    full, shard = b * t * c * e, b * t * c * e // tp
    block = 5 * full - 2 * shard  # wq, wk, wv, w1, w3 vs two region shards
    assert r["old"]["block"] - r["new"]["block"] == block, r
    assert r["old"]["saved"] - r["new"]["saved"] == n_layers * block + full - shard, r
    assert r["new"]["tp_bytes"] - r["old"]["tp_bytes"] == (2 * n_layers + 1) * (tp - 1) / tp * full, r
    assert r["grad_diff"] < 1e-12, r


def test_tp2_and_sp_match_single_process(tmp_path):
    """tp=2 and tp=2 + SP (and SP with tied embeddings and 2 microbatches) reproduce the single-
    process run; SP norm gains stay identical over tp; padded vocabulary rows stay zero;
    vocab-parallel CE equals F.cross_entropy; bytes per step equal the theory; a tp=2 checkpoint
    holds global shapes and resumes identically under tp=1 and tp=2; SP's column linears save the
    sequence shard, not the gathered input, with gradients equal to the reference path."""
    res = run_ranks(_world2, 2, str(tmp_path), timeout_s=240)
    for key in ("tp", "sp", "tied_micro"):
        assert_parity([r[key] for r in res])
    assert_bytes([r["tp"] for r in res], n_tp=2)
    assert_bytes([r["sp"] for r in res], n_tp=2, sp=True)
    assert_bytes([r["tied_micro"] for r in res], n_tp=2, sp=True, micro=2)
    for r in res:
        _assert_sp_saves_shards(r["sp_saved"])
    shapes = res[0]["tp"]["local_shapes"]
    assert shapes["layers.0.attention.wq.weight"] == (16, 32)  # 2 of 4 heads
    assert shapes["layers.0.attention.wk.weight"] == (8, 32)  # 1 of 2 kv heads
    assert shapes["layers.0.feed_forward.w2.weight"] == (32, 24)
    assert shapes["output.weight"] == (31, 32)
    for r in res:
        assert r["norm_spread"] == 0.0
        assert r["norm_moved"] > 1e-3  # the gains did train
        assert r["pad_rows"] == 0.0
        assert r["ce"] < 1e-12
        assert r["ckpt_shapes"] == ((V, 32), (32, 32))  # whole wq moment, unpadded head
        assert r["ckpt_loss"] < 1e-12


def _world4(rank: int, world: int, ckpt_dir: str) -> dict:
    out = {"tp": run_layout(rank, world, tp=4),
           "sp": run_layout(rank, world, tp=4, sequence_parallel=True),
           "zero3": run_layout(rank, world, tp=2, dp_shard=2, zero_stage=3, sequence_parallel=True)}
    cfg = tiny_cfg(world, tp=2, dp_shard=2, zero_stage=3)
    mesh = ParallelDims.from_config(cfg.parallel, world).build_mesh()
    tr = Trainer(cfg, mesh, torch.device("cpu"))
    for step in range(3):
        tr.step(*_local_batch(tr, step))
    out.update(_checkpoint_roundtrip(tr, cfg, mesh, ckpt_dir))
    return out


@pytest.mark.slow  # costly on 2 cores; the same axis keeps a smaller default test
def test_tp4_replicated_kv_heads_match_single_process(tmp_path):
    """tp=4 with 2 kv heads: every rank keeps both kv heads and uses the one its q head needs; the
    kv weights' gradients are summed over tp. Vocabulary 61 padded to 64 (rank 3 holds 13 real
    rows). Parity with and without SP; bytes include the replicated kv all-reduces. Also
    tp2 x ZeRO-3 (dp_shard 2) + SP: parity, and a checkpoint that resumes under tp=1 and the same
    layout."""
    res = run_ranks(_world4, 4, str(tmp_path), timeout_s=300)
    for key in ("tp", "sp", "zero3"):
        assert_parity([r[key] for r in res])
    assert_bytes([r["zero3"] for r in res], axes=("tp",), n_tp=2, n_dp=2, sp=True)
    for r in res:
        assert r["ckpt_shapes"] == ((V, 32), (32, 32))
        assert r["ckpt_loss"] < 1e-12
    assert_bytes([r["tp"] for r in res], n_tp=4)
    assert_bytes([r["sp"] for r in res], n_tp=4, sp=True)
    shapes = res[0]["tp"]["local_shapes"]
    assert shapes["layers.0.attention.wq.weight"] == (8, 32)  # 1 of 4 heads
    assert shapes["layers.0.attention.wk.weight"] == (16, 32)  # both kv heads, one used
    assert shapes["output.weight"] == (16, 32)


def test_tp_config_accepts_layouts():
    cfg = tiny_cfg(4, tp=4, sequence_parallel=True)
    assert ParallelDims.from_config(cfg.parallel, 4).tp == 4
    assert ParallelConfig().cp_layout == "auto"
