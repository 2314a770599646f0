"""KV cache events a scheduler publishes for the cluster prefix index.

Events are produced by the block pool as blocks become cached or are evicted;
the scheduler drains them after each step and ships them in batches, off the
step's critical path, to the kv-cache-manager.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BlockStored:
    """Full blocks that now hold cached KV, in prefix order."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int


@dataclass
class BlockRemoved:
    """Blocks whose cached KV was evicted."""

    block_hashes: list[bytes] = field(default_factory=list)


@dataclass
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
