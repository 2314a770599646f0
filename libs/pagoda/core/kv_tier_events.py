"""KV events of the lower tiers: a block entering or leaving the host ("CPU") or
disk ("DISK") tier, for the cluster prefix index (`kv_events.py`).

The tier indexes only mark which hashes they touched (`touched`, one dict insert per
change); `take` compares each touched hash's membership now with what was last
published and emits the difference. So however a step churned a block (offloaded,
evicted, offloaded again), the events bring a subscriber to the tier's membership at
the end of the step, and a block in two media (onloaded back to the device, still in
the host tier) is in both.

Invariant: after `take`, `published[medium]` equals the set of hashes the medium
holds, as far as the published events say.
"""

from __future__ import annotations

from collections.abc import Callable

from pagoda.core.block_hash import BlockHash
from pagoda.core.kv_events import BlockRemoved, BlockStored, KVEvent


class TierEventLog:
    """Membership changes of one tier medium, as vLLM-format block events."""

    def __init__(self, medium: str, holds: Callable[[BlockHash], bool],
                 block_size: int = 0) -> None:
        self.medium = medium
        self.holds = holds
        self.block_size = block_size
        self.published: set[BlockHash] = set()
        self.touched: dict[BlockHash, None] = {}  # a set in the order of the changes

    def take(self) -> list[KVEvent]:
        """This step's events: stored first, then removed (of different hashes, so
        the order between them does not matter)."""
        stored, removed = [], []
        for block_hash in self.touched:
            held = self.holds(block_hash)
            if held and block_hash not in self.published:
                self.published.add(block_hash)
                stored.append(block_hash)
            elif not held and block_hash in self.published:
                self.published.discard(block_hash)
                removed.append(block_hash)
        self.touched = {}
        events: list[KVEvent] = []
        if stored:
            # As vLLM's OffloadingConnector publishes them: no parent, no token ids.
            events.append(BlockStored(stored, None, [], self.block_size, self.medium))
        if removed:
            events.append(BlockRemoved(removed, self.medium))
        return events

    def republish(self, held: list[BlockHash]) -> None:
        """The subscriber forgot this medium (a resync, a cleared index): publish every
        held hash again at the next `take`."""
        self.published = set()
        self.touched.update(dict.fromkeys(held))
