"""KV cache events a scheduler publishes for the cluster prefix index.

Events are produced by the block pool as blocks become cached or are evicted;
the scheduler drains them after each step and ships them in batches, off the
step's critical path, to the kv-cache-manager.

`medium` is vLLM's name for where the KV lives: "GPU" is the engine's own KV cache
(also on a CPU run, as in vLLM), "CPU" the host-memory tier (vLLM's
OffloadingConnector publishes its blocks under that medium), "DISK" the disk tier.
A block moving device -> host tier is a `BlockRemoved(medium="GPU")` and a
`BlockStored(medium="CPU")`: it stays findable, one tier lower. Each medium's events
are in order among themselves; the index keeps one set per medium, so events of
different media commute.
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
    medium: str = "GPU"


@dataclass
class BlockRemoved:
    """Blocks whose cached KV was evicted."""

    block_hashes: list[bytes] = field(default_factory=list)
    medium: str = "GPU"


@dataclass
class AllBlocksCleared:
    """The whole prefix cache was reset (every medium: the tiers are cleared with it)."""


MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK = "GPU", "CPU", "DISK"
MEDIA = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK)  # fastest first

KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
