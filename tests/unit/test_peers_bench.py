"""``bench/peers.py``: every row's ndtrain layout is a valid config for its process count, and the
quick mode runs its row end to end (both sides, the ratio from their tokens/s, the loss check)."""
from __future__ import annotations

import json
import math

import pytest

from bench import peers
from ndtrain.config import load_config


@pytest.mark.parametrize("name", sorted(peers.ROWS))
def test_every_row_is_a_valid_ndtrain_layout_of_equal_work(name, tmp_path):
    nproc, layout, _ = peers.ROWS[name]
    flat = dict(a[2:].split("=", 1) for a in peers.ndtrain_overrides(nproc, peers.ROWS[name][2], 12, tmp_path))
    cfg = load_config("default", flat, world_size=nproc)  # raises ConfigError naming a bad key or rule
    dp = nproc if layout in ("ddp", "fsdp2") else 1
    assert cfg.training.global_batch_size == 8 * dp and cfg.data.seq_len == 256
    assert (cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads, cfg.model.vocab_size) == (256, 8, 8, 8192)
    assert cfg.training.stop_at_step == 12 and cfg.logging.log_every == 1
    if layout.startswith("pp:"):  # each virtual stage holds the blocks the PyTorch side's does (layers / n)
        from ndtrain.parallel.pp.stage import stage_runs

        n = 2 * (2 if layout in ("pp:interleaved", "pp:zbv", "pp:dualpipev") else 1)
        per = 8 // n
        assert stage_runs(cfg, n) == [list(range(i * per, (i + 1) * per)) for i in range(n)]


@pytest.mark.slow  # two whole processes of the full-size model: minutes on a loaded 2-core machine
def test_quick_mode_runs_one_row_end_to_end(tmp_path):
    out = tmp_path / "peers.json"
    res = peers.main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text())["rounds"] == json.loads(json.dumps(res["rounds"]))  # tuples -> lists
    (rnd,) = res["rounds"]
    (row,) = rnd["rows"]
    assert row["row"] == "single" and len(rnd["load_before"]) == 3
    nd, pt = row["ndtrain"], row["torch"]
    assert row["ratio"] == pytest.approx(nd["tokens_per_s"] / pt["tokens_per_s"])
    assert nd["tokens_per_s"] == pytest.approx(8 * 256 / nd["loop_step_s"])
    for side in (nd, pt):  # both start from a small-normal init: near ln(vocab)
        assert abs(side["step1_loss"] - math.log(8192)) < 0.5
    assert row["loss_mismatch"] is False
    assert nd["threads"].startswith("threads: ") and pt["threads"].endswith(" per rank")
