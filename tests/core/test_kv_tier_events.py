"""The tiers' KV events: a block evicted from the device into the host tier stays
published (medium "CPU"), spilled to disk it is "DISK", dropped from every tier it is
removed; the events are vLLM's BlockStored/BlockRemoved with their `medium`."""

from __future__ import annotations

from pagoda.core.kv_disk_index import KVDiskIndex
from pagoda.core.kv_events import BlockRemoved, BlockStored
from pagoda.core.kv_offload import KVOffloadIndex

H = [bytes([i]) * 8 for i in range(10)]
TOKENS = [tuple(range(4 * i, 4 * i + 4)) for i in range(10)]


def media(events):
    """(kind, medium, hashes) per event."""
    return [(type(e).__name__, e.medium, list(e.block_hashes)) for e in events]


def test_offload_eviction_and_spill_publish_each_medium():
    index = KVOffloadIndex(2, 100, KVDiskIndex(1))
    index.offload(7, H[0], TOKENS[0])
    index.offload(8, H[1], TOKENS[1])
    index.take_ops()
    stored = index.take_events(4)
    assert media(stored) == [("BlockStored", "CPU", [H[0], H[1]])]
    assert stored[0].block_size == 4 and stored[0].token_ids == [] \
        and stored[0].parent_block_hash is None  # as vLLM's OffloadingConnector sends them
    assert index.take_events(4) == []  # nothing changed since
    index.offload(9, H[2], TOKENS[2])  # the host tier evicts H[0]: spilled to disk
    index.take_ops()
    assert media(index.take_events(4)) == [("BlockStored", "CPU", [H[2]]),
                                           ("BlockRemoved", "CPU", [H[0]]),
                                           ("BlockStored", "DISK", [H[0]])]
    index.offload(10, H[3], TOKENS[3])  # H[1] to disk, pushing H[0] out of every tier
    index.take_ops()
    assert sorted(media(index.take_events(4))) == sorted([
        ("BlockStored", "CPU", [H[3]]), ("BlockRemoved", "CPU", [H[1]]),
        ("BlockStored", "DISK", [H[1]]), ("BlockRemoved", "DISK", [H[0]])])


def test_churn_within_one_step_publishes_only_the_end_state():
    index = KVOffloadIndex(1, 100)
    index.offload(1, H[0], TOKENS[0])
    index.take_ops()
    index.take_events(4)
    index.offload(2, H[1], TOKENS[1])  # evicts H[0]
    index.offload(3, H[0], TOKENS[0])  # evicts H[1], H[0] back
    index.take_ops()
    assert index.take_events(4) == []  # H[0] was and is in the tier; H[1] never published


def test_a_resync_republishes_and_a_clear_removes():
    index = KVOffloadIndex(2, 100)
    index.offload(1, H[0], TOKENS[0])
    index.take_ops()
    index.take_events(4)
    index.republish()  # the prefix index forgot this instance
    assert media(index.take_events(4)) == [("BlockStored", "CPU", [H[0]])]
    index.drop(H[0])  # a bad copy: no longer findable in the tier
    assert media(index.take_events(4)) == [("BlockRemoved", "CPU", [H[0]])]
    index.offload(2, H[1], TOKENS[1])
    index.take_ops()
    index.take_events(4)
    index.clear()  # reset_prefix_cache: the device's AllBlocksCleared cleared the index
    assert index.take_events(4) == []
    assert isinstance(BlockStored([], None, [], 4), BlockStored) and BlockRemoved().medium == "GPU"
