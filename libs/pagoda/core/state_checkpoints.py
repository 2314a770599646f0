"""Recurrent-state checkpoints at block boundaries: prefix caching for hybrid models.

A hybrid model's Mamba2 layers keep one state per request, not per block, so a
prefix-cache hit on the attention blocks alone would skip the Mamba layers' pass over
the prefix. This index lets a hit go as far as a block boundary whose state was saved:

    request A's prompt:  [ b0 | b1 | b2 | b3 | 2 tokens ]
    A's prefill saves the state after b3 (its last whole block before the last token)
        into checkpoint slot c, keyed by b3's block hash (the hash of the whole chain)
    request B = A's prompt (or A's prompt + more): the chain b0..b3 is cached and b3
        has a checkpoint -> B starts at token 4*bs with slot c's state copied into its
        own; without a checkpoint on a hit block, the hit stops at the last one with one

The worker holds the checkpoint slots (after the running requests' slots in every
Mamba layer's state pool, `pagoda.model.kv_cache`); this index, on the scheduler,
says which slot holds the state after which block hash.

Invariants:
- a hash is findable (`lookup`) only once the step that saved its state has run
  (`commit`): the restore happens before a step's forward, so a request must never
  restore a state its own step saves (the scheduler also plans a step's saves after
  its admissions; this holds should steps ever be planned ahead);
- an entry lives no longer than its block's hash in the block pool: the pool's
  eviction (a reused block, `reset_prefix_cache`, the device losing its KV) drops it
  (`forget`), so a restored state always belongs to KV blocks that are still cached;
- a slot named by a restore or a save in the step being planned is never given to
  another save in that step.
"""

from __future__ import annotations

from collections import OrderedDict

from pagoda.core.block_hash import BlockHash


class StateCheckpoints:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._by_hash: OrderedDict[BlockHash, int] = OrderedDict()  # LRU first
        self._free = list(range(num_slots - 1, -1, -1))
        self._pending: list[tuple[BlockHash, int]] = []  # saved by the step in flight
        self._pinned: set[int] = set()  # named by the step being planned

    def start_step(self) -> None:
        """A new plan: saves of a plan whose step never reported (it failed) are dropped."""
        for _, slot in self._pending:
            self._free.append(slot)
        self._pending = []
        self._pinned = set()

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The slot holding the state after `block_hash`'s block, pinned for this step."""
        slot = self._by_hash.get(block_hash)
        if slot is not None:
            self._by_hash.move_to_end(block_hash)
            self._pinned.add(slot)
        return slot

    def has(self, block_hash: BlockHash) -> bool:
        return block_hash in self._by_hash or any(h == block_hash for h, _ in self._pending)

    def reserve(self, block_hash: BlockHash) -> int | None:
        """A slot for the state after `block_hash` (saved by the step being planned;
        findable once committed), the least recently used entry evicted for it; None
        when every slot is pinned by this step."""
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((h for h, s in self._by_hash.items() if s not in self._pinned), None)
            if victim is None:
                return None
            slot = self._by_hash.pop(victim)
        self._pinned.add(slot)
        self._pending.append((block_hash, slot))
        return slot

    def commit(self, still_cached) -> None:
        """The step ran: its saves become findable, those whose block is still cached
        (`still_cached(hash)`); the others' slots are freed."""
        for block_hash, slot in self._pending:
            old = self._by_hash.pop(block_hash, None)
            if old is not None:
                self._free.append(old)
            if still_cached(block_hash):
                self._by_hash[block_hash] = slot
            else:
                self._free.append(slot)
        self._pending = []

    def forget(self, block_hash: BlockHash) -> None:
        """The block pool evicted `block_hash`: its state is of no use any more."""
        slot = self._by_hash.pop(block_hash, None)
        if slot is not None:
            self._free.append(slot)
