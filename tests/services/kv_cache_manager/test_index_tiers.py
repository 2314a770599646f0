"""The prefix index records each block's medium, in a real Redis: a block evicted
from a replica's device into its host tier stays findable as "CPU", on disk as
"DISK", and leaves the index only when no tier holds it."""

from __future__ import annotations

from pagoda.core.block_hash import hash_request_tokens
from pagoda.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from pagoda.services.kv_cache_manager.index import PrefixIndex, TierMatch

MODEL = "m"


def hashes(n: int, start: int = 0):
    return hash_request_tokens(list(range(start, start + 4 * n)), 4, "test-seed")


def test_a_block_moves_between_media_and_the_lookup_counts_each(redis_client):
    index = PrefixIndex(redis_client)
    h = hashes(6)
    index.apply(MODEL, 4, "s1", "e1", 0, [BlockStored(h, None, [], 4)])
    assert index.lookup_tiers(MODEL, 4, h) == {"s1": TierMatch(device=6)}
    # The device evicts the last four into the host tier, which spills one to disk.
    index.apply(MODEL, 4, "s1", "e1", 1, [BlockRemoved(h[2:]),
                                          BlockStored(h[2:5], None, [], 4, "CPU"),
                                          BlockStored(h[5:], None, [], 4, "DISK")])
    assert index.lookup_tiers(MODEL, 4, h) == {"s1": TierMatch(2, 3, 1)}
    assert index.lookup(MODEL, 4, h) == {"s1": 2}  # the device-only lookup as before
    # Onloaded back: on the device again (and still in the host tier).
    index.apply(MODEL, 4, "s1", "e1", 2, [BlockStored(h[2:3], None, [], 4)])
    assert index.lookup_tiers(MODEL, 4, h) == {"s1": TierMatch(3, 2, 1)}
    # Dropped from the host tier with nothing below: the run ends there.
    index.apply(MODEL, 4, "s1", "e1", 3, [BlockRemoved(h[3:4], "CPU")])
    assert index.lookup_tiers(MODEL, 4, h) == {"s1": TierMatch(3)}
    # A block only on the device after a tier block is no hit (the tier lookup stops).
    index.apply(MODEL, 4, "s1", "e1", 4, [BlockStored(h[3:4], None, [], 4, "CPU"),
                                          BlockStored(h[5:], None, [], 4, "GPU"),
                                          BlockRemoved(h[5:], "DISK")])
    assert index.lookup_tiers(MODEL, 4, h) == {"s1": TierMatch(3, 2)}
    # Reset: every medium goes.
    index.apply(MODEL, 4, "s1", "e1", 5, [AllBlocksCleared()])
    assert index.lookup_tiers(MODEL, 4, h) == {}
    assert not redis_client.keys("pagoda:kv:m:4:block:*")
    assert not redis_client.smembers("pagoda:kv:m:4:tiered")  # back to one round trip


def test_a_snapshot_or_a_dropped_instance_clears_its_tiers_too(redis_client):
    index = PrefixIndex(redis_client)
    h = hashes(3)
    index.apply(MODEL, 4, "s1", "e1", 0, [BlockStored(h, None, [], 4, "CPU")])
    assert index.lookup_tiers(MODEL, 4, h) == {"s1": TierMatch(host=3)}
    index.apply(MODEL, 4, "s1", "e1", 1, [], snapshot=h[:1])  # the replica resynced
    assert index.lookup_tiers(MODEL, 4, h) == {"s1": TierMatch(device=1)}
    index.apply(MODEL, 4, "s1", "e1", 2, [BlockStored(h, None, [], 4, "DISK")])
    assert index.deregister(MODEL, 4, "s1", "e1") == 1
    assert index.lookup_tiers(MODEL, 4, h) == {}
    assert not redis_client.keys("pagoda:kv:m:4:*")


def test_an_unknown_medium_is_ignored_not_fatal(redis_client):
    index = PrefixIndex(redis_client)
    h = hashes(2)
    reply = index.apply(MODEL, 4, "s1", "e1", 0, [BlockStored(h, None, [], 4, "TAPE"),
                                                  BlockStored(h[:1], None, [], 4)])
    assert not reply.resync_required
    assert index.lookup_tiers(MODEL, 4, h) == {"s1": TierMatch(device=1)}
