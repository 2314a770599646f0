"""Which LoRA adapters this replica holds, for the gateway's adapter-aware routing.

The gpu-worker loads an adapter when a request naming it is first scheduled and keeps
the `--max-cpu-loras` most recently used ones in host memory (pagoda.lora.manager).
`HeldAdapters` mirrors that cache from the requests this scheduler accepts, so
`GetLoad` can tell the gateway where an adapter's next request finds it loaded.
It is a routing hint: a request routed elsewhere still runs (its replica loads it).

Invariant: at most `capacity` names, the most recently used last.
"""

from __future__ import annotations

from collections import OrderedDict


class HeldAdapters:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._names: OrderedDict[str, None] = OrderedDict()

    def touch(self, name: str) -> None:
        self._names[name] = None
        self._names.move_to_end(name)
        while len(self._names) > self.capacity:
            self._names.popitem(last=False)

    def names(self) -> list[str]:
        return list(self._names)
