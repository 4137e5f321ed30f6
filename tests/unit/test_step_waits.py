"""The straggler report's busy time counts only the step's own thread as waiting.

``FlightRecorder.wait_s`` is subtracted from a step's wall time to get the rank's own work; the
pipeline's receiver threads and an overlapped pair's backward thread wait *beside* the step, so
counting their waits made every pipeline rank's busy time 0 (wall - waits of several threads) and a
straggler warning fire on sub-millisecond differences.
"""
from __future__ import annotations

import threading

from ndtrain.fault.straggler import MIN_GAP_S, THRESHOLD, StragglerMonitor
from ndtrain.parallel.flight_recorder import FlightRecorder


def test_only_the_main_threads_waits_count():
    rec = FlightRecorder()
    rec.add_wait(0.25)
    worker = threading.Thread(target=rec.add_wait, args=(10.0,))
    worker.start()
    worker.join()
    assert rec.wait_s == 0.25


def test_a_sub_millisecond_gap_is_not_a_straggler(capsys):
    """Two ranks whose own work differs by 2x but by less than MIN_GAP_S: no warning; the same
    ratio at 100 ms per step: a warning naming the slow rank."""
    import torch

    from ndtrain.mesh import AxisGroup
    from ndtrain.parallel import comm

    assert THRESHOLD < 4 / 3
    for busy, warned in ((0.0004, False), (0.1, True)):
        mon = StragglerMonitor(AxisGroup("world", 2, 0, None), torch.device("cpu"))
        mon.record(busy, 0.0)
        real = comm.all_gather_into

        def fake(out, local, group, busy=busy):  # rank 1's window: twice rank 0's step and busy time
            out[:9] = local
            out[9:] = torch.tensor([2 * busy] * 3 + [0.0] * 3 + [2 * busy] * 3, dtype=torch.float64)

        comm.all_gather_into = fake
        try:
            row = mon.report()
        finally:
            comm.all_gather_into = real
        assert row["slowest_rank"] == 1 and abs(row["slowest_vs_median"] - 4 / 3) < 1e-9
        assert ("straggler: rank 1" in capsys.readouterr().out) is warned, (busy, MIN_GAP_S)
