"""The worker's encoder cache: counted lookups, LRU eviction beyond its capacity, and
entries a running request still needs never evicted."""

import torch

from pagoda.worker.encoder_cache import EncoderCache


def rows(n):
    return torch.zeros(n, 4)


def test_unneeded_entries_leave_oldest_first_needed_ones_stay():
    cache = EncoderCache(capacity_rows=10)
    cache.put("a", rows(6))
    cache.put("b", rows(6))
    cache.evict(needed=["a"])  # 12 rows > 10: b goes although a is older (a is needed)
    assert "a" in cache and "b" not in cache
    cache.put("c", rows(6))
    cache.get("a")  # a is now the most recent
    cache.evict(needed=[])
    assert "a" in cache and "c" not in cache and cache.num_rows == 6


def test_within_capacity_nothing_is_evicted_and_lookups_are_counted():
    cache = EncoderCache(capacity_rows=100)
    assert cache.lookup("a") is None
    cache.put("a", rows(5))
    cache.put("b", rows(5))
    cache.evict(needed=[])
    assert cache.lookup("a") is not None and len(cache) == 2
    assert cache.take_counts() == (2, 1)
    assert cache.take_counts() == (0, 0)
