"""DualPipeV's overlapped forward & backward pairs, run in two threads (``parallel.pp_overlap``).

DeepSeek-V3 (technical report 2024, section 3.2.1) overlaps, inside each pair "forward of one
microbatch + backward of another", the expert all-to-all of one with the compute of the other; on
GPUs with two streams and SM partitioning. Here, on CPU, the pair's backward B runs in a worker
thread while the main thread runs its forward F: torch operators and gloo waits release the GIL,
and CPU autograd executes on the thread that calls it, so while one thread waits in an all-to-all
the other computes.

Why it is safe (each point is a precondition the rules check, ``rules.overlap_blockers``):

* collectives: a process group must see its collectives in the same order on every rank. F's go
  to ``ep`` (count exchange, dispatch, combine) and to ``dp_cp`` (the Switch loss's load reducer);
  B's only to ``ep_bwd``, the ``ep`` twin that every backward all-to-all uses, paired or not
  (``ep.collectives.backward_group``). ep peers share the pp rank, so they run the same action
  list and each group's order is the list's order. Tensor / context parallel and ZeRO-3 would put
  forward and backward collectives on one group, so they turn the overlap off;
* pipeline messages: B's input gradient is sent by the main thread after the join, right after F's
  output (schedule order, so NCCL-style in-order matching would hold too); receives are already
  threads (``p2p.Receiver``), ``take`` is thread-safe;
* gradients: DualPipeV splits the backward, so B only returns gradients (``torch.autograd.grad``):
  it never accumulates ``.grad`` nor fires data-parallel hooks; W does, on the main thread;
* module state: F writes per-microbatch state (MoE aux sums and load statistics, MTP logits, the
  runtime's output capture) that B never reads without a recompute (activation checkpointing is
  off); F and B of a pair run different chunks, hence different layers; the byte counters
  (``comm.count``, ``LoadStats.a2a_bytes``) and the flight recorder take locks.

The results are bitwise those of running the pair sequentially: the same operators on the same
tensors, each sum in the same order.
"""
from __future__ import annotations

import threading

from ndtrain.parallel.pp.schedules import Action


def run_pair(rt, i: int, f: Action, b: Action) -> None:
    """Run actions ``i`` (``f``, a forward) and ``i + 1`` (``b``, a split backward's B) of the rank's
    list on ``rt`` (a ``PipelineRuntime`` inside ``run``): B's receive and autograd in a worker
    thread, F on the calling thread; join; then send B's input gradient. Re-raises the first error
    of either thread (F's if both failed) after the join."""
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
