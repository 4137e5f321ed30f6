"""DualPipeV's overlapped F & B pairs in two threads (``parallel.pp_overlap``; DeepSeek-V3 report
2024, section 3.2.1: one's expert all-to-all under the other's compute).

B runs in a worker thread while the main thread runs F: torch operators and gloo waits release the
GIL, and CPU autograd runs on its calling thread. Safe because (each checked by
``rules.overlap_blockers``): F's collectives are on ``ep`` / ``dp_cp``, B's only on ``ep_bwd``, and
ep peers run the same action list, so every group sees one order (tp, cp and ZeRO-3 would share a
group between F and B); B's input gradient is sent by the main thread after the join; a split B
only returns gradients (W touches ``.grad`` on the main thread); F and B run different chunks and
no recompute reads per-microbatch state; byte counters and the flight recorder take locks.
Results are bitwise the sequential pair's."""
from __future__ import annotations

import threading

from ndtrain.parallel.pp.schedules import Action


def run_pair(rt, i: int, f: Action, b: Action) -> None:
    """Run actions ``i`` (F) and ``i + 1`` (a split B) on ``rt``: B's receive and autograd in a worker
    thread, F here; join; send B's input gradient. Re-raises the first error (F's if both failed)."""
    st = rt._step
    box: dict = {}

    def backward() -> None:
        try:
            for o in rt.observers:
                o.on_wait(b)
            g = rt._receive(b)
            for o in rt.observers:
                o.on_action_start(b)
            box["gx"] = rt._input_grad(b, g)
            for o in rt.observers:
                o.on_action_end(b)
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread after the join
            box["error"] = e

    worker = threading.Thread(target=backward, name=f"pp-{b}", daemon=True)
    worker.start()
    try:
        rt._run_action(i, f)
    finally:  # never leave B running (it may be inside a collective) past this pair
        worker.join()
    if "error" in box:
        raise box["error"]
    st.index = i + 1
    rt._reap_sends()
    rt._send(box["gx"], b)
