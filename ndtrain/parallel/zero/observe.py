"""Instrumentation of the sharded data-parallel hooks, kept out of their hot paths.

``ZeroDataParallel`` and ``FullyShardedDataParallel`` hold ``observers`` (an ``Observers``): named
slots the caller fills. With every slot empty a hook does one truthiness test and no other work.
An observer implements any of:

* ``on_gather(dp, prefetched)`` - ZeRO-3 waited on a unit's all-gather; ``prefetched`` tells whether
  it had been started ahead (forward / backward prefetch) or was issued on demand;
* ``on_state(dp)`` - the tensors ``dp`` holds just changed (a unit gathered, a gradient arrived, a
  reduction launched): the points where in-hook memory peaks are sampled
  (``ndtrain.mem_account.MemorySampler`` reads ``dp.memory_tensors()``).

Attach: ``dp.observers["gathers"] = GatherCounter()``; detach: ``dp.observers["gathers"] = None``.
"""
from __future__ import annotations


class Observers:
    """Named observer slots; ``active`` is the tuple of attached observers (hooks loop over it)."""

    def __init__(self):
        self._slots: dict[str, object] = {}
        self.active: tuple = ()

    def __setitem__(self, name: str, observer) -> None:
        """Attach ``observer`` under ``name`` (replacing the previous one); None detaches."""
        if observer is None:
            self._slots.pop(name, None)
        else:
            self._slots[name] = observer
        self.active = tuple(self._slots.values())

    def __getitem__(self, name: str):
        return self._slots.get(name)

    def __bool__(self) -> bool:
        return bool(self.active)

    def gather(self, dp, prefetched: bool) -> None:
        for o in self.active:
            if hasattr(o, "on_gather"):
                o.on_gather(dp, prefetched)

    def state(self, dp) -> None:
        for o in self.active:
            if hasattr(o, "on_state"):
                o.on_state(dp)


class GatherCounter:
    """Counts ZeRO-3 all-gathers waited on, by origin: ``counts = {"prefetched": n, "on_demand": m}``."""

    def __init__(self):
        self.counts = {"prefetched": 0, "on_demand": 0}

    def on_gather(self, dp, prefetched: bool) -> None:
        self.counts["prefetched" if prefetched else "on_demand"] += 1
