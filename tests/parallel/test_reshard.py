"""Checkpoints that reshard: save under one layout and world size, resume under another.

Everything goes through ``ndtrain.train.loop.run`` on real data (a byte-tokenised corpus prepared in
``tmp_path``): model, optimizer moments and steps, LR schedule and the data position.

Chain: ZeRO-3 on 4 ranks trains steps 1-4 and saves; DDP on 2 ranks resumes at 5, trains 5-8 and
saves; ZeRO-1 on 2 ranks resumes from that and trains 9-12; one plain process resumes from the
ZeRO-3 checkpoint and trains 5-12. Reference: one uninterrupted single-process run of 12 steps.
float64: the layouts differ only in summation order (~1e-13 per step), so continued losses must
match the reference to 1e-6 relative (the issue's tolerance), and a wrong shard / moment / step /
LR / sample position would be off by far more (the loss moves ~1e-2 per step).
"""
from __future__ import annotations

from pathlib import Path

import torch

from ndtrain.checkpoint import dcp as ckpt
from ndtrain.config import load_config
from ndtrain.data import prepare_data
from ndtrain.train.loop import run
from ndtrain.train.metrics import read_metrics
from tests.corpus import source_text
from tests.dist_utils import run_ranks


def _cfg(tmp_path: Path, world: int, **over):
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        corpus.write_text(source_text(40000))
    base = {"data.source": str(corpus), "data.tokenizer": "bytes", "data.cache_dir": str(tmp_path / "cache"),
            "data.seq_len": 16, "model.vocab_size": 257, "model.dim": 30, "model.n_heads": 3,
            "model.n_kv_heads": 1, "model.ffn_hidden": 45, "training.dtype": "float64",
            "training.steps": 12, "training.global_batch_size": 8, "training.micro_batch_size": 1,
            "training.lr": 0.01, "training.grad_clip": 0.5, "training.eval_every": 0,
            "training.eval_batches": 1, "training.sample_tokens": 4, "logging.log_every": 1,
            "logging.plot": False, "checkpoint.every": 4, "checkpoint.keep_last": 3}
    base.update({k: str(v) for k, v in over.items()})
    return load_config("debug", base, world_size=world)


def _run(rank: int, world: int, tmp: str, run_name: str, over: dict) -> list[dict]:
    tmp_path = Path(tmp)
    cfg = _cfg(tmp_path, world, **over)
    return run(cfg, tmp_path / run_name, prepare_data(cfg.data, cfg.model.vocab_size), torch.device("cpu"))


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def test_zero3_checkpoint_resumes_under_ddp_zero1_and_one_process(tmp_path):
    torch.set_num_threads(1)
    cfg = _cfg(tmp_path, 1)
    data = prepare_data(cfg.data, cfg.model.vocab_size)  # cached: the ranks reuse it
    run(cfg, tmp_path / "ref", data, torch.device("cpu"))
    ref = _losses(tmp_path / "ref")

    run_ranks(_run, 4, str(tmp_path), "zero3", {"parallel.zero_stage": 3, "training.stop_at_step": 4},
              timeout_s=300)
    z3 = ckpt.latest_checkpoint(tmp_path / "zero3" / "checkpoints")
    assert z3.name == "step_00000004"
    run_ranks(_run, 2, str(tmp_path), "ddp", {"checkpoint.load_from": z3, "training.stop_at_step": 8})
    ddp = ckpt.latest_checkpoint(tmp_path / "ddp" / "checkpoints")
    assert ddp.name == "step_00000008"
    run_ranks(_run, 2, str(tmp_path), "zero1", {"checkpoint.load_from": ddp, "parallel.zero_stage": 1})
    run(_cfg(tmp_path, 1, **{"checkpoint.load_from": z3}), tmp_path / "single", data, torch.device("cpu"))

    got = {**_losses(tmp_path / "zero3"), **_losses(tmp_path / "ddp"), **_losses(tmp_path / "zero1")}
    single = _losses(tmp_path / "single")
    assert sorted(got) == list(range(1, 13)) and sorted(single) == list(range(5, 13))
    for step in range(1, 13):
        assert abs(got[step] - ref[step]) <= 1e-6 * ref[step], (step, got[step], ref[step])
    for step in range(5, 13):
        assert abs(single[step] - ref[step]) <= 1e-6 * ref[step], (step, single[step], ref[step])
    assert ref[12] < ref[1] - 0.05  # it trains: a resume that restarted from scratch would show
    # metrics.jsonl carries the memory accounting and the per-axis traffic of the sharded run
    rows = [r for r in read_metrics(tmp_path / "zero3") if "loss" in r]
    assert all(r["mem_state_peak_bytes"] > 0 and r["mem_activations_peak_bytes"] > 0 for r in rows)
    assert rows[0]["mem_params_bytes"] * 4 <= rows[0]["mem_state_peak_bytes"]  # ZeRO-3: 1/4 of 16/N
    assert rows[-1]["comm_bytes"]["dp_shard_cp"] > 0
