"""Spawn gloo ranks for a test: one helper, free port, per-rank results, clear errors and timeouts."""
from __future__ import annotations

import os
import pickle
import socket
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, out_dir: str, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    out = Path(out_dir) / f"rank{rank}.pkl"
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=__import__("datetime").timedelta(seconds=120))
        result = fn(rank, world, *args)
        dist.barrier()  # no rank tears the group down while another still communicates
        out.write_bytes(pickle.dumps(("ok", result)))
    except BaseException:  # report the rank's traceback to the test process
        out.write_bytes(pickle.dumps(("error", traceback.format_exc())))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world: int, *args, timeout_s: float = 300.0) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo processes; return the per-rank results.

    ``fn`` must be importable (module level). A failing rank raises AssertionError carrying its
    traceback; a hang past ``timeout_s`` kills the ranks and fails.
    """
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_entry, args=(world, _free_port(), tmp, fn, args), nprocs=world,
                                 join=False, start_method="spawn")
        import time

        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        p.kill()
                    raise AssertionError(f"ranks did not finish within {timeout_s:.0f} s (hang?)")
        except mp.ProcessRaisedException:
            pass
        except mp.ProcessExitedException:
            pass
        results = []
        for r in range(world):
            path = Path(tmp) / f"rank{r}.pkl"
            if not path.exists():
                raise AssertionError(f"rank {r} exited without a result")
            status, value = pickle.loads(path.read_bytes())
            if status == "error":
                raise AssertionError(f"rank {r} failed:\n{value}")
            results.append(value)
        return results
