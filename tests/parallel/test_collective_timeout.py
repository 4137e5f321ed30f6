"""Collective timeouts and the flight recorder (``ndtrain.parallel.flight_recorder``).

4 gloo ranks, mesh dp_replicate 2 x dp_shard 2 (dp_shard groups {0, 1} and {2, 3}),
``collective_timeout_s`` = 3 s:

* rank 1 sleeps 8 s inside an all-reduce over ``dp_shard`` (``dist.all_reduce`` patched in its
  process to sleep before issuing): rank 0 fails after 3 s + the 1.5 s grace with
  ``CollectiveTimeoutError`` naming rank 0, suspect rank 1, axis ``dp_shard`` and the op; well
  before rank 1 wakes (elapsed < 7.5 s). Its ``flight_recorder/rank0.json`` ends with that
  all-reduce, still open (``t_end`` None), after the completed warm-up all-reduce.
* rank 3 sleeps before sending a pipeline message (``p2p.send_tensor``) to rank 2: rank 2's
  ``recv_tensor`` fails in the same way, naming rank 3 (the one peer of a p2p) and the axis.

The sleepers then issue their operations: rank 1's all-reduce completes against rank 0's
still-posted one; rank 3's send finds the connection closed (gloo drops a pair whose receive timed
out), which is what a peer that gave up looks like. Events ``collective_timeout`` are logged by the
failing ranks.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from tests.dist_utils import run_ranks

SLEEP_S = 8.0


def _check(rank: int, world: int, run_dir: str) -> dict:
    import torch.distributed as dist

    from ndtrain.mesh import ParallelDims
    from ndtrain.parallel import comm, flight_recorder
    from ndtrain.parallel.pp import p2p

    flight_recorder.configure(timeout_s=3.0, capacity=16, run_dir=run_dir)
    mesh = ParallelDims(dp_replicate=2, dp_shard=2, world_size=world).build_mesh()
    group = mesh.group("dp_shard")
    comm.all_reduce(torch.ones(4), group)  # warm-up: a completed entry in the recorder
    if rank == 1:
        real = dist.all_reduce

        def sleepy(*a, **k):
            time.sleep(SLEEP_S)
            return real(*a, **k)

        dist.all_reduce = sleepy
    if rank == 3:
        time.sleep(SLEEP_S)
    t0 = time.monotonic()
    err = None
    try:
        if rank in (0, 1):
            comm.all_reduce(torch.ones(1000), group)
        elif rank == 2:
            p2p.recv_tensor(group, 1, msg_tag=10)
        else:
            works, _keep = p2p.send_tensor(torch.ones(3), group, 0, msg_tag=10)
            for w in works:
                w.wait()
    except flight_recorder.CollectiveTimeoutError as e:
        err = str(e)
    except RuntimeError as e:  # rank 3, awake: gloo closed the pair when rank 2's receive timed out
        return {"err": None, "late": str(e)}
    out = {"err": err, "elapsed": time.monotonic() - t0}
    if err:
        out["recorder"] = json.loads((Path(run_dir) / "flight_recorder" / f"rank{rank}.json").read_text())
    return out


def test_sleeping_rank_makes_peers_fail_naming_rank_and_axis(tmp_path):
    res = run_ranks(_check, 4, str(tmp_path), timeout_s=120)
    assert res[1]["err"] is None and res[3]["err"] is None  # the sleepers raise no timeout of their own
    assert "late" not in res[1] and "Connection closed" in res[3].get("late", "Connection closed")
    r0, r2 = res[0], res[2]
    assert r0["err"] and 3.0 <= r0["elapsed"] < SLEEP_S - 0.5, r0
    assert r0["err"].startswith("rank 0: collective all_reduce #") and "'dp_shard'" in r0["err"]
    assert "rank(s) [1] never reached" in r0["err"] and "(4000 bytes)" in r0["err"]  # 2 (N-1)/N * 4000
    entries = r0["recorder"]["entries"]
    assert [(e["op"], e["axis"]) for e in entries] == [("all_reduce", "dp_shard")] * 2
    assert entries[0]["t_end"] is not None and entries[1]["t_end"] is None
    assert entries[1]["bytes"] == 4000 and entries[1]["seq"] == entries[0]["seq"] + 1
    assert r2["err"] and 3.0 <= r2["elapsed"] < SLEEP_S - 0.5, r2
    assert "recv(from dp_shard rank 1, tag 10)" in r2["err"] and "rank(s) [3] never reached" in r2["err"]
    from ndtrain.events import read_events

    ev = read_events(tmp_path, "collective_timeout")
    assert sorted((e["rank"], e["axis"], tuple(e["suspects"])) for e in ev) == [(0, "dp_shard", (1,)),
                                                                                  (2, "dp_shard", (3,))]
