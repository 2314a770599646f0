"""The scheduler's index of the host-memory KV tier (vLLM's --kv-offloading-size).

    device pool evicts block b (hash h)  --offload(b -> slot s)-->  host tier [s: h]
    a new request misses h on the device --lookup h--> slot s --onload(s -> new block)

The worker holds the bytes (`pagoda.worker.host_kv_tier`); this index decides which
slot holds which hash (LRU, `num_slots` of them) and plans the copies of each step,
which travel in the plan (`SchedulerOutput.kv_offloads` / `kv_onloads`). The worker
runs them in the same step, before the forward: offloads first (their device blocks
are reused by this step), then onloads. So an onloaded block holds its KV before any
token of the step reads it, exactly as a block computed this step does, and the
scheduler may count it as cached at once (`--kv-offloading-onload sync`).

Asynchronous onloads (the default): the copies of a request's hits travel in
`kv_async_onloads`; the worker starts them after the step's offloads and runs them in
the background over several steps while the request waits out of the batch, until the
worker reports them done (`finish_onloads`). Until then its slots are *held*: the
same rule as a step's pins, kept across steps (no offload reuses or rewrites a held
slot, no disk drop deletes or spill rewrites a held record).

Invariants:
  * only a block whose KV was written in an earlier step is offloaded (one that was
    cached this step and evicted again before its step ran holds no KV yet);
  * a slot planned for an onload this step is not reused by an offload of this step;
    one an asynchronous onload reads is neither reused nor rewritten until it is done;
  * the index may be wrong about the worker (a worker restart, a refused step): the
    worker checks each onload's hash and checksum and recomputes on a mismatch, so a
    stale entry costs time, never a wrong answer.

A slot taken twice in one step (the tier churns) keeps only its last offload: the
worker's copies of one step may run in any order on CUDA, so two copies into one slot
could leave the first one's bytes under the second one's hash.

With a disk tier (`kv_disk_index.py`) an entry the host tier evicts is spilled to disk
instead of forgotten. One whose slot this same step wrote is spilled from its device
block (spills run before the step's offloads, so the slot does not hold it yet; the
device block still does until the forward). A lookup then finds each block on the
host first, else on disk.
Not thread-safe: the scheduler's thread owns it.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

from pagoda.core.block_hash import BlockHash
from pagoda.core.kv_disk_index import KVDiskIndex
from pagoda.core.kv_events import MEDIUM_CPU, MEDIUM_DISK, KVEvent
from pagoda.core.kv_tier_events import TierEventLog
from pagoda.messages import KVOffload, KVOnload, KVSpill

GIB = 1024 ** 3


@dataclass
class KVOffloadStats:
    """Cumulative counters of one tier (blocks), since start."""

    queries: int = 0  # blocks looked up in the tier (device misses)
    hits: int = 0  # blocks onloaded from it
    stored: int = 0  # blocks offloaded into it
    evictions: int = 0  # blocks the tier dropped to make room (LRU)
    block_bytes: int = 0  # bytes of one whole block (all layers, keys and values)


def num_host_slots(size_gib: float, block_bytes: int) -> int:
    """How many whole blocks `size_gib` GiB of host memory hold."""
    if size_gib <= 0 or block_bytes <= 0:
        return 0
    return int(size_gib * GIB) // block_bytes


class KVOffloadIndex:
    """hash -> (slot, token ids) for the blocks the host tier holds, least recently
    used first."""

    def __init__(self, num_slots: int, block_bytes: int,
                 disk: KVDiskIndex | None = None) -> None:
        if num_slots <= 0:
            raise ValueError(f"the host KV tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._entries: OrderedDict[BlockHash, tuple[int, tuple[int, ...]]] = OrderedDict()
        self._slot_hash: dict[int, BlockHash] = {}
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._pinned: set[int] = set()  # slots read by this step's onloads
        # Slots read by asynchronous onloads in flight (across steps), per request.
        self._held: Counter[int] = Counter()
        self._loading: dict[str, list[tuple[int, BlockHash]]] = {}
        self._offloads: list[KVOffload] = []
        self._onloads: list[KVOnload] = []
        self._async_onloads: list[KVOnload] = []
        self._written: dict[int, int] = {}  # slot -> device block this step copies in
        self.stats = KVOffloadStats(block_bytes=block_bytes)
        self.disk = disk
        self.disk_stats = KVOffloadStats(block_bytes=block_bytes) if disk is not None else None
        # The prefix index's view of the tiers (medium "CPU" / "DISK"): see kv_tier_events.
        self.events = TierEventLog(MEDIUM_CPU, self.__contains__)
        self.disk_events = (TierEventLog(MEDIUM_DISK, disk.__contains__) if disk is not None
                            else None)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._entries

    # ------------------------------------------------------------------ offload
    def offload(self, block_id: int, block_hash: BlockHash, token_ids: tuple[int, ...]) -> None:
        """The device pool is reusing `block_id`, which held `block_hash`: keep its KV
        (a copy planned for this step), evicting the least recently used entry if full."""
        entry = self._entries.get(block_hash)
        if entry is not None:
            self._entries.move_to_end(block_hash)
            if entry[0] in self._held:  # an onload in flight reads it: never rewritten
                return
            # The tier has it already (onloaded earlier): copy it again into its slot
            # all the same, so a slot whose copy went bad (the worker recomputed it) heals.
            self._offloads.append(KVOffload(block_id, entry[0], block_hash))
            self._written[entry[0]] = block_id
            self.stats.stored += 1
            return
        slot = self._take_slot()
        if slot is None:
            return  # every slot is read by this step's onloads: this block is dropped
        self._entries[block_hash] = (slot, tuple(token_ids))
        self._slot_hash[slot] = block_hash
        self.events.touched[block_hash] = None
        self._offloads.append(KVOffload(block_id, slot, block_hash))
        self._written[slot] = block_id
        self.stats.stored += 1

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        for block_hash, (slot, token_ids) in self._entries.items():  # LRU first
            if slot not in self._pinned and slot not in self._held:
                del self._entries[block_hash]
                del self._slot_hash[slot]
                self.events.touched[block_hash] = None
                self.stats.evictions += 1
                source = self._written.pop(slot, -1)
                if source >= 0:  # copied in this step: that copy is superseded
                    self._offloads = [op for op in self._offloads if op.slot != slot]
                if self.disk is not None:
                    self.disk_stats.evictions += self.disk.spill(slot, block_hash, token_ids,
                                                                 source)
                    self.disk_stats.stored += block_hash in self.disk  # not if all pinned
                return slot
        return None

    # ------------------------------------------------------------------ onload
    def lookup(self, block_hashes, all_token_ids, start: int, end: int,
               block_size: int) -> list[tuple[int, BlockHash]]:
        """(host slot, hash) of the longest run of blocks `start..end-1` the tiers hold
        (a prefix hit must stay whole from block 0), slot -1 for a block on disk;
        pinned for this step."""
        hits: list[tuple[int, BlockHash]] = []
        disk = self.disk
        for i in range(start, end):
            self.stats.queries += 1
            block_hash = block_hashes[i]
            tokens = tuple(all_token_ids[i * block_size:(i + 1) * block_size])
            entry = self._entries.get(block_hash)
            if entry is not None and entry[1] == tokens:
                hits.append((entry[0], block_hash))
                self._pinned.add(entry[0])
                continue
            if disk is None:
                break
            self.disk_stats.queries += 1
            if not disk.get(block_hash, tokens):
                break
            hits.append((-1, block_hash))
        return hits

    def held_run(self, block_hashes, all_token_ids, start: int, block_size: int) -> int:
        """How many blocks from `start` on the tiers hold in a row (host, else disk; the
        tokens checked), as `lookup` would find them now; pins nothing, counts nothing
        (a peer's prefix lease asking what an onload would bring up)."""
        n = 0
        for i in range(start, len(block_hashes)):
            tokens = tuple(all_token_ids[i * block_size:(i + 1) * block_size])
            entry = self._entries.get(block_hashes[i])
            if entry is not None and entry[1] == tokens:
                n += 1
            elif self.disk is not None and self.disk.holds(block_hashes[i], tokens):
                n += 1
            else:
                break
        return n

    def unpin(self, hits: list[tuple[int, BlockHash]]) -> None:
        """The lookup's request was not admitted this step."""
        for slot, block_hash in hits:
            if slot < 0:
                self.disk.unpin(block_hash)
            else:
                self._pinned.discard(slot)

    def plan_onloads(self, req_id: str, first_index: int, hits: list[tuple[int, BlockHash]],
                     block_ids: list[int], asynchronous: bool = False) -> None:
        """Request `req_id` takes `hits` as its blocks `first_index..`, into `block_ids`.
        `asynchronous`: the copies run in the background; the slots and records stay
        held until `finish_onloads(req_id)`."""
        ops = self._async_onloads if asynchronous else self._onloads
        if asynchronous:
            self._loading[req_id] = list(hits)
        for i, ((slot, block_hash), block_id) in enumerate(zip(hits, block_ids)):
            if slot < 0:
                self.disk.touch(block_hash)
                if asynchronous:
                    self.disk.hold(block_hash)
                ops.append(KVOnload(req_id, first_index + i, -1, block_id, block_hash, "disk"))
                self.disk_stats.hits += 1
                continue
            self._entries.move_to_end(block_hash)
            if asynchronous:
                self._held[slot] += 1
            ops.append(KVOnload(req_id, first_index + i, slot, block_id, block_hash))
            self.stats.hits += 1

    def finish_onloads(self, req_id: str) -> None:
        """The worker finished (or gave up) the asynchronous onloads of `req_id`: its
        slots and records may be reused."""
        for slot, block_hash in self._loading.pop(req_id, []):
            if slot < 0:
                self.disk.release(block_hash)
                continue
            self._held[slot] -= 1
            if self._held[slot] <= 0:
                del self._held[slot]

    @property
    def num_loading(self) -> int:
        """Requests whose asynchronous onloads are in flight."""
        return len(self._loading)

    def take_async_onloads(self) -> list[KVOnload]:
        """This step's asynchronous onloads, for the plan (they start after its offloads)."""
        ops, self._async_onloads = self._async_onloads, []
        return ops

    # ------------------------------------------------------------------ step
    def take_ops(self) -> tuple[list[KVOffload], list[KVOnload], list[KVSpill], list[bytes]]:
        """This step's copies (offloads, onloads, spills, disk drops), for the plan;
        the pins end with the step."""
        spills, drops = self.disk.take_ops() if self.disk is not None else ([], [])
        ops = self._offloads, self._onloads, [KVSpill(*spill) for spill in spills], drops
        self._offloads, self._onloads = [], []
        self._pinned.clear()
        self._written.clear()
        return ops

    def forget(self, block_hash: BlockHash) -> None:
        """An onload of `block_hash` failed its checks on the worker: forget it (host
        and disk), unless an onload in flight still reads it (that one will fail too)."""
        entry = self._entries.get(block_hash)
        if entry is not None and entry[0] not in self._held and entry[0] not in self._pinned:
            self.drop(block_hash)
        if self.disk is not None:
            self.disk.forget(block_hash)

    def drop(self, block_hash: BlockHash) -> None:
        """Forget one entry (its copy is known to be bad)."""
        entry = self._entries.pop(block_hash, None)
        if entry is not None:
            self.events.touched[block_hash] = None
            del self._slot_hash[entry[0]]
            self._free_slots.append(entry[0])

    def clear(self) -> None:
        """Forget every entry (reset_prefix_cache), on disk too."""
        for block_hash in list(self._entries):
            self.drop(block_hash)
        if self.disk is not None:
            self.disk.clear()
        self.republish()  # the index cleared every medium with the device's reset

    # ------------------------------------------------------------------ KV events
    def take_events(self, block_size: int) -> list[KVEvent]:
        """The tiers' KV events since the last call (medium "CPU", then "DISK")."""
        self.events.block_size = block_size
        events = self.events.take()
        if self.disk_events is not None:
            self.disk_events.touched |= self.disk.touched
            self.disk.touched = {}
            self.disk_events.block_size = block_size
            events += self.disk_events.take()
        return events

    def republish(self) -> None:
        """Publish every block the tiers hold again (the prefix index forgot them)."""
        self.events.republish(list(self._entries))
        if self.disk_events is not None:
            self.disk_events.republish(self.disk.hashes())
