"""Chat batches (labels only on assistant turns, a different count in every row) train exactly under
data parallelism with microbatches.

Reference: one process, the 4 packed rows as one microbatch, float64. Two gloo ranks (plain DDP and
ZeRO-3), 2 rows each, ``micro_batch_size=1``: each microbatch holds another number of supervised
labels, so only a loss weighted by the global count of labels (not a mean per rank or microbatch)
gives the same loss and the same updated parameters (1e-12 relative).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ndtrain.config import DataConfig, validate
from ndtrain.data.chat import ChatData, prepare_chat
from ndtrain.mesh import ParallelDims
from ndtrain.train.trainer import Trainer
from tests.dist_utils import run_ranks
from tests.utils import rel_err, tiny_config

T = 64


def _trainer(world: int, micro: int, zero: int) -> Trainer:
    cfg = tiny_config({"model.vocab_size": 300, "model.max_seq_len": T, "data.seq_len": T,
                       "training.micro_batch_size": micro, "training.grad_clip": 0.0},
                      parallel={"dp_shard": -1, "zero_stage": zero})
    validate(cfg, world)
    return Trainer(cfg, ParallelDims.from_config(cfg.parallel, world).build_mesh(), torch.device("cpu"))


def _full_params(tr: Trainer) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in tr.tensor_state()["model"].items()}


def _run(rank: int, world: int, path: str, zeros: tuple[int, ...]) -> list[dict]:
    x, y, _ = ChatData(path).get("train", range(4), T)
    n, out = 4 // world, []
    for zero in zeros:  # one process group, both layouts
        torch.manual_seed(0)
        tr = _trainer(world, 1 if world > 1 else 0, zero)
        step = tr.step(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n])
        out.append({"loss": step["loss"], "n_tokens": step["n_tokens"], "params": _full_params(tr),
                    "per_row": (y != -100).sum(1).tolist()})
    return out


def _prepared(tmp_path: Path) -> str:
    convs = [[{"role": "user", "content": "q" * (3 + 5 * i)}, {"role": "assistant", "content": "a" * (2 + 7 * i)}]
             for i in range(5)]
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    cfg = DataConfig(source=str(src), tokenizer="bytes", chat_template="chatml", cache_dir=str(tmp_path / "cache"),
                     val_fraction=0.2)
    path = prepare_chat(cfg, 300)
    assert ChatData(path).num_sequences("train", T) == 4  # 4 rows, one conversation each
    return str(path)


def test_chat_loss_is_exact_over_ranks_and_microbatches(tmp_path):
    torch.set_num_threads(1)
    path = _prepared(tmp_path)
    (ref,) = _run(0, 1, path, (0,))
    assert len(set(ref["per_row"])) == 4 and ref["n_tokens"] == sum(ref["per_row"])  # uneven rows
    for rank_out in run_ranks(_run, 2, path, (0, 3), timeout_s=300):
        for zero, r in zip((0, 3), rank_out, strict=True):
            assert r["n_tokens"] == ref["n_tokens"]
            assert rel_err(r["loss"], ref["loss"]) <= 1e-12, (zero, r["loss"], ref["loss"])
            for k, v in ref["params"].items():
                assert rel_err(r["params"][k], v) <= 1e-12, (zero, k)
