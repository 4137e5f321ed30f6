"""Observers of the sharded data-parallel hooks, out of their hot paths (empty slots: one truthiness
test). ``on_gather(dp, prefetched)``: ZeRO-3 waited on an all-gather; ``on_state(dp)``: the held
tensors changed (where ``mem_account.MemorySampler`` samples). Attach:
``dp.observers["gathers"] = GatherCounter()``; ``None`` detaches."""
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
