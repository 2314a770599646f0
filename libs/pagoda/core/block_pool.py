"""The pool of KV cache blocks: ref counts, the prefix-cache map and the LRU of free blocks.

    free queue (LRU, evict from the left)          cached map
    [b7 b3 b9 ...]  <- freed blocks appended        hash -> block
       ^ may still hold a cached prefix: a hit takes it back out of the queue

A block is in exactly one of two states: in use (ref_cnt > 0, not in the free
queue) or free (ref_cnt == 0, in the free queue). A free block that still has a
`block_hash` keeps its KV for a future prefix hit until it is reused, at which
point its hash is evicted (and a `BlockRemoved` event recorded).

With a host KV tier (`kv_offload.py`) the scheduler sets `offload_sink` while it plans
a step: a cached block evicted then, whose KV an earlier step wrote, is handed to the
sink (its id, hash and tokens) before it is reused, so the tier can keep its KV.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence

from pagoda.core.block_hash import BlockHash
from pagoda.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # The tokens whose KV the block holds once full; compared on a hash hit so a
    # hash collision can never serve another prefix's KV.
    token_ids: tuple[int, ...] | None = None


class BlockPool:
    """Owns all `num_blocks` blocks. Not thread-safe: one scheduler thread uses it."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 enable_kv_events: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.enable_kv_events = enable_kv_events
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVCacheBlock] = {}
        self._events: list[KVEvent] = []
        # Set by the scheduler while it plans a step (None: evictions are not offloaded).
        self.offload_sink = None
        # Blocks cached since `start_step`: their KV is written by the step being planned.
        self._fresh: set[int] = set()
        # Called with each hash the pool forgets (a hybrid model's state checkpoints,
        # core/state_checkpoints.py, live no longer than their block's hash).
        self.on_evict = None

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        """Fraction of blocks in use (free blocks holding cached KV count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash, token_ids: Sequence[int]) -> KVCacheBlock | None:
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def is_cached(self, block_hash: BlockHash) -> bool:
        return block_hash in self._cached

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash the pool can serve right now (for an index resync)."""
        return list(self._cached)

    # ------------------------------------------------------------------ actions
    def start_step(self) -> None:
        """A new step is planned: every block cached before holds its KV now."""
        self._fresh.clear()

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks (pulling free ones out of the queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` least recently freed blocks; the caller checked there are enough."""
        if num_blocks > len(self._free):
            raise RuntimeError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        removed: list[bytes] = []
        new_blocks = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                removed.append(block.block_hash)
                if self.offload_sink is not None and block.block_id not in self._fresh:
                    self.offload_sink(block.block_id, block.block_hash, block.token_ids)
                self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        if removed and self.enable_kv_events:
            self._events.append(BlockRemoved(removed))
        return new_blocks

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero join the queue's
        tail in the given order (so pass them in the order they should be evicted)."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"block {block.block_id} freed twice")
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash],
                          all_token_ids: Sequence[int], num_cached: int, num_full: int) -> None:
        """Register blocks `num_cached .. num_full-1` of a request under their hashes."""
        if not self.enable_caching or num_full <= num_cached:
            return
        bs = self.block_size
        run_start: int | None = None  # first block of the current run of new cache entries
        for i in range(num_cached, num_full + 1):
            newly_cached = i < num_full and self._cache_block(blocks[i], block_hashes[i],
                                                              all_token_ids[i * bs:(i + 1) * bs])
            if newly_cached and run_start is None:
                run_start = i
            elif not newly_cached and run_start is not None:
                self._record_stored(block_hashes, all_token_ids, run_start, i)
                run_start = None

    def cache_block(self, block: KVCacheBlock, block_hashes: Sequence[BlockHash],
                    token_ids: Sequence[int], index: int) -> bool:
        """Register one block as block `index` of the chain `block_hashes` (its KV was
        written from elsewhere: a disaggregated prefill's pull); False if that hash is
        served already. Recorded as stored, so the prefix index learns of it."""
        if not self.enable_caching or not self._cache_block(block, block_hashes[index],
                                                            token_ids):
            return False
        if self.enable_kv_events:
            parent = block_hashes[index - 1] if index > 0 else None
            self._events.append(BlockStored([block_hashes[index]], parent, list(token_ids),
                                            self.block_size))
        return True

    def _cache_block(self, block: KVCacheBlock, block_hash: BlockHash,
                     token_ids: Sequence[int]) -> bool:
        if block.block_hash is not None or block_hash in self._cached:
            return False  # a prefix hit, or another block already serves this prefix
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block
        self._fresh.add(block.block_id)
        return True

    def _record_stored(self, block_hashes: Sequence[BlockHash], all_token_ids: Sequence[int],
                       start: int, end: int) -> None:
        if not self.enable_kv_events:
            return
        bs = self.block_size
        parent = block_hashes[start - 1] if start > 0 else None
        self._events.append(BlockStored(list(block_hashes[start:end]), parent,
                                        list(all_token_ids[start * bs:end * bs]), bs))

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Forget the hashes of free blocks whose KV was never written after all (their
        step was refused: core/step_recovery.py), so no request takes them as a hit."""
        removed = []
        for block in blocks:
            if block.ref_cnt == 0 and block.block_hash is not None \
                    and self._cached.get(block.block_hash) is block:
                removed.append(block.block_hash)
                self._evict(block)
        if removed and self.enable_kv_events:
            self._events.append(BlockRemoved(removed))

    def forget_contents(self) -> None:
        """The device lost every block's KV (a step failed midway and the worker's
        cache was set up again): forget every cached hash, of blocks in use too, so
        nothing is ever taken as a hit; the blocks themselves stay where they are."""
        if not self._cached:
            return
        for block in list(self._cached.values()):
            self._evict(block)
        if self.enable_kv_events:
            self._events.append(AllBlocksCleared())

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        for block in list(self._cached.values()):
            self._evict(block)
        if self.enable_kv_events:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def _evict(self, block: KVCacheBlock) -> None:
        del self._cached[block.block_hash]
        if self.on_evict is not None:
            self.on_evict(block.block_hash)
        block.block_hash = None
        block.token_ids = None
