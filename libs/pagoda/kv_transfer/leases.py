"""The prefill side's leases: a finished prefill's blocks, pinned for a decode replica.

    request done ──pin──► lease L: blocks [b3 b7 b9], ref held, expires at t+timeout
    decode pulled ──release(L)──► refs dropped (blocks stay cached, evictable)
    nobody came   ──reap(now)───► refs dropped at expiry
    KV re-allocated ──invalidate()──► every lease dropped (its blocks hold zeros now)

A lease is a reference in the block pool like a running request's, so a pinned block
is never reused while the lease lives; its KV stays put for the pull. Release after
expiry answers False: the decode side must then discard what it pulled (the block may
have been reused meanwhile). Not thread-safe: the scheduler's engine thread owns it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagoda.core.block_hash import BlockHash
from pagoda.core.block_pool import BlockPool, KVCacheBlock


@dataclass
class Lease:
    lease_id: str
    request_id: str
    blocks: list[KVCacheBlock]
    block_hashes: list[BlockHash]
    expiry: float

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]


class LeaseTable:
    """Invariant: each block of each live lease holds one reference for that lease,
    and `num_leased_blocks` is the sum of the live leases' blocks."""

    def __init__(self, pool: BlockPool, timeout_s: float,
                 clock: Callable[[], float] = time.time) -> None:
        self.pool = pool
        self.timeout_s = timeout_s
        self.clock = clock
        self.leases: dict[str, Lease] = {}
        self.num_leased_blocks = 0

    def pin(self, request_id: str, block_hashes: Sequence[BlockHash],
            token_ids: Sequence[int]) -> Lease | None:
        """Lease the cached leading blocks of a request that just finished (its blocks
        were freed this step, so they are still cached). None when no block is."""
        bs = self.pool.block_size
        blocks = []
        for i, block_hash in enumerate(block_hashes):
            block = self.pool.get_cached_block(block_hash, token_ids[i * bs:(i + 1) * bs])
            if block is None:
                break
            blocks.append(block)
        if not blocks:
            return None
        self.pool.touch(blocks)
        lease = Lease(uuid.uuid4().hex, request_id, blocks, list(block_hashes[:len(blocks)]),
                      self.clock() + self.timeout_s)
        self.leases[lease.lease_id] = lease
        self.num_leased_blocks += len(blocks)
        return lease

    def release(self, lease_id: str) -> bool:
        """Drop a lease; False if it is not live (expired, released, unknown)."""
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return False
        self._unpin(lease)
        return True

    def reap(self, now: float | None = None) -> list[Lease]:
        """Drop every lease past its expiry; the dropped ones."""
        now = self.clock() if now is None else now
        expired = [lease for lease in self.leases.values() if lease.expiry <= now]
        for lease in expired:
            del self.leases[lease.lease_id]
            self._unpin(lease)
        return expired

    def invalidate(self) -> list[Lease]:
        """Drop every lease (the worker's KV cache was set up again: the blocks they
        name hold zeros), so a later `release` of any of them answers False; the
        dropped ones."""
        dropped = list(self.leases.values())
        self.leases.clear()
        for lease in dropped:
            self._unpin(lease)
        return dropped

    def _unpin(self, lease: Lease) -> None:
        self.num_leased_blocks -= len(lease.blocks)
        self.pool.free_blocks(reversed(lease.blocks))  # tail first, like a request
