"""The scheduler's index of the disk KV tier (--kv-offloading-disk-path), below the
host tier (`kv_offload.py`).

    host tier evicts h (slot s) --spill(s, h)-->  disk tier [h]  (LRU, `num_records`)
    disk tier evicts h'          --drop(h')-->    the record's file is deleted
    a request misses h on the device and the host --lookup--> onload h from disk

The worker holds the records (`pagoda.worker.disk_kv_tier`), one file per block hash;
this index decides which hashes are on disk and plans each step's spills and drops
(`SchedulerOutput.kv_spills` / `kv_disk_drops`) and disk onloads (`kv_onloads` with
medium "disk"). The worker runs spills, then drops, then offloads, then onloads, so
a record spilled this step may be onloaded this step, and a slot is written to disk
before this step's offload reuses it.

Invariants:
  * a hash onloaded this step is pinned: no drop of this step deletes its record;
    one an asynchronous onload reads is held until it is done: no drop deletes it and
    no spill rewrites it meanwhile;
  * a dropped hash is forgotten here before its drop is planned, so no later lookup
    of this step finds it;
  * the index may be wrong about the worker (a restart dropped the records, a write
    failed, a file was deleted or corrupted): the worker verifies each record's hash,
    identity and checksum and recomputes on a mismatch, so a stale entry costs time,
    never a wrong answer.
Not thread-safe: the scheduler's thread owns it.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from pagoda.core.block_hash import BlockHash

GIB = 1024 ** 3
RECORD_OVERHEAD = 4096  # the record's header, rounded up to a page


def num_disk_records(size_gib: float, block_bytes: int) -> int:
    """How many whole-block records `size_gib` GiB of disk hold (headers counted)."""
    if size_gib <= 0 or block_bytes <= 0:
        return 0
    return int(size_gib * GIB) // (block_bytes + RECORD_OVERHEAD)


class KVDiskIndex:
    """hash -> token ids of the blocks the disk tier holds, least recently used first."""

    def __init__(self, num_records: int) -> None:
        if num_records <= 0:
            raise ValueError(f"the disk KV tier needs room for one block, got {num_records}")
        self.num_records = num_records
        self._entries: OrderedDict[BlockHash, tuple[int, ...]] = OrderedDict()
        self._pinned: set[BlockHash] = set()
        self._held: Counter[BlockHash] = Counter()  # read by asynchronous onloads in flight
        # (host slot, hash, device block or -1), this step
        self.spills: list[tuple[int, BlockHash, int]] = []
        self.drops: list[BlockHash] = []
        self.touched: dict[BlockHash, None] = {}  # entered or left (KV events), in order

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._entries

    def spill(self, slot: int, block_hash: BlockHash, token_ids: tuple[int, ...],
              block_id: int = -1) -> int:
        """The host tier evicted `block_hash` from `slot` (or from device block
        `block_id`, when it took the block this same step): keep it on disk, dropping
        the least recently used unpinned records to make room. The number dropped; the
        block is lost instead (no spill) when every record is pinned."""
        if block_hash in self.drops:  # dropped earlier this step: the spill runs first
            self.drops.remove(block_hash)
        if block_hash in self._entries:  # written again all the same: heals a bad record
            self._entries.move_to_end(block_hash)
            if block_hash not in self._held:  # not while an onload in flight reads it
                self.spills.append((slot, block_hash, block_id))
            return 0
        dropped = 0
        while len(self._entries) >= self.num_records:
            victim = next((h for h in self._entries
                           if h not in self._pinned and h not in self._held), None)
            if victim is None:
                return dropped
            del self._entries[victim]
            self.touched[victim] = None
            self.drops.append(victim)
            dropped += 1
        self._entries[block_hash] = tuple(token_ids)
        self.touched[block_hash] = None
        self.spills.append((slot, block_hash, block_id))
        return dropped

    def holds(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> bool:
        """Whether the disk holds `block_hash` with these tokens (pins nothing)."""
        return self._entries.get(block_hash) == token_ids

    def get(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> bool:
        """Whether the disk holds `block_hash` with these tokens; pinned for this step."""
        held = self._entries.get(block_hash)
        if held is None or held != token_ids:
            return False
        self._pinned.add(block_hash)
        return True

    def unpin(self, block_hash: BlockHash) -> None:
        self._pinned.discard(block_hash)

    def hold(self, block_hash: BlockHash) -> None:
        """An asynchronous onload reads the record: kept as it is until `release`."""
        self._held[block_hash] += 1

    def release(self, block_hash: BlockHash) -> None:
        self._held[block_hash] -= 1
        if self._held[block_hash] <= 0:
            del self._held[block_hash]

    def touch(self, block_hash: BlockHash) -> None:
        """An onload read it: most recently used."""
        if block_hash in self._entries:
            self._entries.move_to_end(block_hash)

    def forget(self, block_hash: BlockHash) -> None:
        """Its record failed its checks on the worker: dropped, unless read meanwhile."""
        if (block_hash in self._entries and block_hash not in self._held
                and block_hash not in self._pinned):
            del self._entries[block_hash]
            self.touched[block_hash] = None
            self.drops.append(block_hash)

    def hashes(self) -> list[BlockHash]:
        return list(self._entries)

    def take_ops(self) -> tuple[list[tuple[int, BlockHash, int]], list[BlockHash]]:
        """This step's spills and drops; the pins end with the step."""
        ops = self.spills, self.drops
        self.spills, self.drops = [], []
        self._pinned.clear()
        return ops

    def clear(self) -> None:
        """Forget every record (reset_prefix_cache); their files are deleted."""
        kept = self._pinned | self._held.keys()
        self.drops.extend(h for h in self._entries if h not in kept)
        self.touched.update(dict.fromkeys(self._entries))
        self._entries = OrderedDict((h, t) for h, t in self._entries.items() if h in kept)
