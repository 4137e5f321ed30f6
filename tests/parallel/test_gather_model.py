"""The end-of-run sample works under every layout: ``rundir.gather_model``
assembles a parallelized trainer's weights into one single-process ``Transformer`` on rank 0.

Reference: the single-process model built from the same config and seed (``build_model``). Every
layout initialises its shards from that same seeded model, and gathering only copies, so the
gathered weights must be bit-identical (exact comparison); a wrong slice, name, stage or expert
owner would differ. Then rank 0 samples with the trainer's own ``sample_text`` on the gathered model
and must produce the single-process model's text. One 2-rank group runs every layout.
"""
from __future__ import annotations

import torch

from ndtrain.config import load_config
from ndtrain.mesh import ParallelDims
from ndtrain.model import build_model
from ndtrain.train.rundir import gather_model
from ndtrain.train.trainer import Trainer
from tests.dist_utils import run_ranks

MOE = {"model.moe_experts": 4, "model.moe_top_k": 2, "model.moe_ffn_hidden": 32}
# tp=2 is covered end to end by tests/integration/test_after_training.py; ZeRO-3 shards over cp here
LAYOUTS = {
    "pp2_tied": {"parallel.pp": 2, "model.tie_embeddings": True, "training.micro_batch_size": 4},
    "cp2_zero3": {"parallel.cp": 2, "parallel.zero_stage": 3},
    "ep2_moe": {"parallel.ep": 2, **MOE},
}


def _cfg(over: dict):
    base = {"data.tokenizer": "bytes", "model.vocab_size": 300, "training.dtype": "float32"}
    return load_config("debug", {**base, **over}, world_size=2)


class _Bytes:
    """The ``"bytes"`` tokenizer stand-in ``sample_text`` reads from ``data.tokenizer``."""

    def __init__(self):
        from ndtrain.data.tokenizer import ByteTokenizer

        self.tokenizer = ByteTokenizer()


def _rank(rank: int, world: int) -> dict:
    from ndtrain.train.loop import sample_text

    torch.set_num_threads(1)
    out = {}
    for name, over in LAYOUTS.items():
        cfg = _cfg(over)
        mesh = ParallelDims.from_config(cfg.parallel, world).build_mesh("cpu")
        tr = Trainer(cfg, mesh, torch.device("cpu"))
        assert tr.plan.sample_skip_reason  # the layout splits the forward: rank 0 cannot sample alone
        model = gather_model(tr, cfg)
        if rank == 0:
            out[name] = ({k: v.clone() for k, v in model.state_dict().items()},
                         sample_text(tr, _Bytes(), cfg, model))
        else:
            assert model is None
    return out


def test_gather_model_under_every_layout():
    results = run_ranks(_rank, 2)[0]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the ranks: the reference sample computes what rank 0 did
    try:
        _compare(results)
    finally:
        torch.set_num_threads(threads)


def _compare(results: dict) -> None:
    from ndtrain.train.loop import sample_text

    assert sorted(results) == sorted(LAYOUTS)
    for name, (state, text) in results.items():
        cfg = _cfg(LAYOUTS[name])
        ref = build_model(cfg.model, "cpu", torch.float32, cfg.training.seed)
        want = ref.state_dict()
        assert sorted(state) == sorted(want), name
        for k, v in want.items():
            assert torch.equal(state[k], v), f"{name}: {k}"

        class _Tr:  # what sample_text reads from a trainer
            device, autocast, model = torch.device("cpu"), False, ref

        assert text == sample_text(_Tr(), _Bytes(), cfg, ref), name
