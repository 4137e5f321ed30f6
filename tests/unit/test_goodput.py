"""Goodput accounting (``ndtrain.fault.goodput``): categories, recomputed steps after a restart or a
rollback, the job's total over attempts, the summary line; and one real single-process run whose
``final`` event adds up to its wall time."""
from __future__ import annotations

import time

import pytest

from ndtrain.events import log_event, read_events
from ndtrain.fault import goodput as G


def test_combine_splits_startups_and_puts_the_unaccounted_rest_in_restarts():
    a0 = {"attempt": 0, "steps": 10.0, "startup": 3.0, "eval": 1.0, "checkpoint_save": 0.5, "checkpoint_load": 0.0,
          "recomputed": 0.0, "other": 0.5, "n_steps": 20, "n_recomputed": 0}
    a1 = {"attempt": 1, "steps": 5.0, "startup": 2.0, "eval": 0.0, "checkpoint_save": 0.5, "checkpoint_load": 0.25,
          "recomputed": 1.0, "other": 0.25, "n_steps": 10, "n_recomputed": 2}
    t = G.combine([a0, a1], wall_s=30.0)
    assert (t["steps"], t["startup"], t["recomputed"], t["checkpoint_load"]) == (15.0, 3.0, 1.0, 0.25)
    assert t["restarts"] == 2.0 + (30.0 - 24.0)  # attempt 1's start-up + 6 s nobody accounted for
    assert sum(t[k] for k in G.CATEGORIES) == pytest.approx(30.0)
    assert (t["goodput"], t["n_steps"], t["n_recomputed"]) == (0.5, 30, 2)
    assert G.summary_line(t) == (
        "goodput 50.0%: steps 15.0 s (30 steps) of 30.0 s wall; start-up 3.0 s, eval 1.0 s, checkpoint save "
        "1.0 s, load 0.2 s, restarts 8.0 s, recomputed 1.0 s (2 steps), other 0.8 s")


def test_steps_reached_before_a_restart_or_a_rollback_are_recomputed(tmp_path, monkeypatch):
    with G.job_clock():
        job = float(__import__("os").environ["NDTRAIN_JOB_T0"])
        G.mark_attempt(0)
        first = G.Goodput(tmp_path)
        assert (first.attempt, first.t0, first.high) == (0, job, 0)  # attempt 0 starts with the job
        first.begin_steps()
        for s in range(1, 8):
            first.step(s, 0.1)
        first.report()
        log_event(tmp_path, "restart", step=4, last_step=7)  # killed after step 7, resumes at 4
        time.sleep(0.01)  # the clock must move, so the attempt's own start is later than the job's
        G.mark_attempt(1)
        second = G.Goodput(tmp_path)
        assert second.attempt == 1 and second.high == 7 and second.t0 > job
        second.begin_steps()
        for s in range(5, 11):  # 5, 6, 7 again; 8-10 new
            second.step(s, 0.1)
        second.redo(10, lambda: time.sleep(0.01))  # a rollback at step 10 to step 8
        for s in (9, 10, 11):
            second.step(s, 0.1)
        assert second.n == {"steps": 4, "recomputed": 5} and second.acc["checkpoint_load"] >= 0.01
        said = []
        ev = second.finish(say=said.append)
    assert "NDTRAIN_JOB_T0" not in __import__("os").environ  # restored after the job
    assert ev["final"] and ev["attempts"] == 2 and (ev["n_steps"], ev["n_recomputed"]) == (7 + 4, 5)
    assert ev["steps"] == pytest.approx(1.1) and ev["recomputed"] == pytest.approx(0.5)
    assert said == [G.summary_line({k: ev[k] for k in ev if k not in ("time", "kind")})]
    assert [e["final"] for e in read_events(tmp_path, "goodput")] == [False, True]


def test_a_real_run_writes_a_final_event_that_adds_up(tmp_path, capsys):
    import torch

    from ndtrain.config import load_config
    from ndtrain.data import prepare_data
    from ndtrain.train.loop import run
    from tests.corpus import source_text

    torch.set_num_threads(1)
    (tmp_path / "c.txt").write_text(source_text(20000))
    cfg = load_config("debug", {"data.source": str(tmp_path / "c.txt"), "data.tokenizer": "bytes",
                                "data.cache_dir": str(tmp_path / "cache"), "model.vocab_size": 257,
                                "model.dim": 32, "training.steps": 4, "checkpoint.every": 2,
                                "training.eval_every": 0, "training.sample_tokens": 2, "logging.plot": False})
    run(cfg, tmp_path / "run", prepare_data(cfg.data, cfg.model.vocab_size), torch.device("cpu"))
    evs = read_events(tmp_path / "run", "goodput")
    assert [e["final"] for e in evs] == [False, False, True]  # after each checkpoint, then the job
    part, final = evs[1], evs[2]
    assert (part["last_step"], part["n_steps"], final["n_steps"], final["n_recomputed"]) == (4, 4, 4, 0)
    assert final["checkpoint_save"] > 0 and final["eval"] > 0 and final["steps"] > 0
    assert sum(final[k] for k in G.CATEGORIES) == pytest.approx(final["wall_s"], abs=0.01)
    assert G.summary_line(final) in capsys.readouterr().out
