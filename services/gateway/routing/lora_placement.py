"""Adapter-aware routing: a LoRA adapter's requests go where it is already loaded.

Each replica reports the adapters it holds (`GetLoad.lora_adapters`: its
`--max-cpu-loras` most recently used, polled), and this gateway remembers where it
sent each adapter in the last `RECENT_S` seconds, since a poll lags behind. For a
request with an adapter, the router's policy (kv_aware: prefix and load) chooses
among:

  1. the replicas holding it, unless every one of them has more than SPILL_WAITING
     requests waiting (loading costs a replica a disk read and may evict another
     adapter, so affinity comes first, but a hot adapter must not queue up on one
     replica; a request or two waiting for the next step is normal);
  2. then also the replicas with room to load it without evicting one;
  3. when none has room, every replica with LoRA enabled (one evicts its least
     recently used adapter).

A replica without LoRA (`GetModelInfo.max_cpu_loras` 0) never gets an adapter's
request while one with LoRA is routable.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

RECENT_S = 10.0
SPILL_WAITING = 2  # requests waiting on every holder beyond which others may load it


class AdapterPlacement:
    """Invariant: `_routed` holds (address, adapter) -> when this gateway last routed
    that adapter there; entries older than RECENT_S are ignored and pruned."""

    def __init__(self) -> None:
        self._routed: dict[tuple[str, str], float] = {}

    def record(self, address: str, adapter: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._routed[(address, adapter)] = now
        if len(self._routed) > 4096:  # many adapters over many replicas: drop the stale
            self._routed = {k: t for k, t in self._routed.items() if now - t < RECENT_S}

    def held(self, replica, now: float) -> set[str]:
        """The adapters `replica` holds, as reported or as recently routed there."""
        load = getattr(replica, "load", None)
        held = set(load.lora_adapters) if load is not None else set()
        held.update(name for (address, name), t in self._routed.items()
                    if address == replica.address and now - t < RECENT_S)
        return held

    def candidates(self, live: Sequence, adapter: str, now: float | None = None) -> list:
        """The replicas among `live` the policy may choose from for `adapter`."""
        now = time.monotonic() if now is None else now
        capable = [r for r in live if _max_adapters(r) > 0]
        if not capable:
            return list(live)  # the replica refuses it with a clear error
        held = {r.address: self.held(r, now) for r in capable}
        holders = [r for r in capable if adapter in held[r.address]]
        if holders and not all(_has_waiting(r) for r in holders):
            return holders
        with_room = [r for r in capable if adapter not in held[r.address]
                     and len(held[r.address]) < _max_adapters(r)]
        return holders + with_room or capable


def _has_waiting(replica) -> bool:
    load = getattr(replica, "load", None)
    return load is not None and load.num_waiting > SPILL_WAITING


def _max_adapters(replica) -> int:
    info = getattr(replica, "info", None)
    return info.max_cpu_loras if info is not None else 0
