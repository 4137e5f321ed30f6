"""One thread policy for every launch: threads per rank from the cores it was given, capped (with a
warning) by an ``OMP_NUM_THREADS`` of the launching environment, and printed at start-up."""
from __future__ import annotations

import torch

from ndtrain.cli.launch import launch
from ndtrain.config import load_config
from ndtrain.spawn import (
    THREAD_POLICY_ENV,
    ThreadPolicy,
    current_policy,
    policy_env,
    running_under,
    thread_policy,
)
from tests.corpus import source_text


def test_threads_are_the_cores_shared_by_the_local_ranks():
    assert thread_policy(2, {}, cores=16).threads == 8
    assert thread_policy(3, {}, cores=16).threads == 5  # floor: no rank oversubscribes a core
    assert thread_policy(4, {}, cores=2).threads == 1  # more ranks than cores: one each
    assert thread_policy(1, {"OMP_NUM_THREADS": "junk"}, cores=4).cap is None
    p = thread_policy(1, {}, cores=4)
    assert p.warning() is None and p.describe(4) == "threads: 4 per rank (4 cores / 1 local rank(s), from the cores)"


def test_environment_cap_below_the_cores_warns_and_is_obeyed():
    p = thread_policy(1, {"OMP_NUM_THREADS": "1"}, cores=2)
    assert p.threads == 1
    assert p.warning() == ("warning: OMP_NUM_THREADS=1 in the environment caps each rank at 1 compute thread(s), "
                           "below the 2 core(s) it was given (2 cores / 1 local rank(s)); unset it or raise it "
                           "to use them")
    assert p.describe(1) == "threads: 1 per rank (2 cores / 1 local rank(s), capped by OMP_NUM_THREADS=1)"
    assert thread_policy(2, {"OMP_NUM_THREADS": "1"}, cores=2).warning() is None  # the cap is the share
    assert thread_policy(2, {"OMP_NUM_THREADS": "8"}, cores=8).threads == 4  # a cap above the share: the share
    assert thread_policy(1, {}, cores=2).describe(1).endswith("; torch uses 1 (set after start-up)")


def test_rejects_no_ranks():
    import pytest

    with pytest.raises(ValueError, match=r"local_ranks \(0\) must be >= 1"):
        thread_policy(0, {}, cores=2)


def test_spawned_ranks_read_the_launchers_policy(monkeypatch):
    p = ThreadPolicy(cores=16, local_ranks=4, cap=2)
    monkeypatch.setenv(THREAD_POLICY_ENV, policy_env(p)[THREAD_POLICY_ENV])
    assert current_policy() == p and current_policy().threads == 2
    monkeypatch.delenv(THREAD_POLICY_ENV)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert current_policy().local_ranks == 2


def test_running_under_sets_and_restores_torch_threads():
    before = torch.get_num_threads()
    with running_under(ThreadPolicy(cores=1, local_ranks=1, cap=None)) as p:
        assert torch.get_num_threads() == 1 and current_policy() is p
    assert torch.get_num_threads() == before and current_policy() is not p


def test_one_process_run_prints_the_policy_and_the_cap_warning(tmp_path, monkeypatch, capsys):
    """``ndtrain train --nproc 1`` under ``OMP_NUM_THREADS=1``: the run follows the same policy as a
    spawned launch and its start-up summary says so (the warning whenever this machine has > 1 core)."""
    (tmp_path / "corpus.txt").write_text(source_text(60000))
    cfg = load_config("debug", {"data.source": str(tmp_path / "corpus.txt"), "data.tokenizer": "bytes",
                                "data.cache_dir": str(tmp_path / "cache"), "training.steps": "1",
                                "training.eval_every": "0", "training.sample_every": "0", "checkpoint.every": "0"})
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    expected = thread_policy(1)  # this machine's cores under the cap
    launch(cfg, tmp_path / "run", 1, announce=True)
    lines = capsys.readouterr().out.splitlines()
    assert expected.describe(1) in lines
    if expected.given > 1:
        assert expected.warning() in lines
    else:
        assert not any(line.startswith("warning: OMP_NUM_THREADS") for line in lines)
