"""The prefill replicas' leases in Redis: recorded with their blocks, gone when released,
when their instance restarts or is dropped, and at their expiry."""

from __future__ import annotations

import time

from pagoda.core.block_hash import hash_request_tokens
from pagoda.services._proto.pagoda.kv_cache_manager.v1 import kv_cache_manager_pb2 as pb
from pagoda.services.kv_cache_manager.index import PrefixIndex

MODEL = "m"


def lease(lease_id: str, expiry: float, n: int = 2) -> pb.KvLease:
    hashes = hash_request_tokens(list(range(4 * n)), 4, "seed")
    return pb.KvLease(lease_id=lease_id, request_id=f"req-{lease_id}", block_ids=list(range(n)),
                      block_hashes=hashes, expiry=expiry)


def lease_keys(redis_client) -> list[bytes]:
    return sorted(redis_client.keys("pagoda:kv:*lease*"))


def test_a_lease_is_recorded_until_released(redis_client):
    index = PrefixIndex(redis_client)
    expiry = time.time() + 30
    index.apply(MODEL, 4, "p1", "e1", 0, [], leases_pinned=[lease("L1", expiry),
                                                            lease("L2", expiry, 3)])
    live = index.leases(MODEL, 4, "p1")
    assert set(live) == {"L1", "L2"}
    assert live["L2"]["block_ids"] == "0,1,2" and live["L2"]["request_id"] == "req-L2"
    assert 0 < redis_client.ttl(f"pagoda:kv:{MODEL}:4:lease:p1:L1") <= 31
    assert index.list_instances(MODEL, 4)[0].num_leases == 2
    index.apply(MODEL, 4, "p1", "e1", 1, [], leases_released=["L1"])
    assert set(index.leases(MODEL, 4, "p1")) == {"L2"}
    # A duplicate or out-of-order batch still carries its lease changes.
    index.apply(MODEL, 4, "p1", "e1", 1, [], leases_released=["L2"])
    assert index.leases(MODEL, 4, "p1") == {} and lease_keys(redis_client) == []


def test_a_restart_or_a_dead_instance_takes_its_leases(redis_client):
    clock = [1000.0]
    index = PrefixIndex(redis_client, heartbeat_timeout=10, clock=lambda: clock[0])
    far = time.time() + 300
    index.apply(MODEL, 4, "p1", "e1", 0, [], leases_pinned=[lease("L1", far)])
    index.apply(MODEL, 4, "p1", "e2", 0, [])  # restarted: its old blocks are gone
    assert index.leases(MODEL, 4, "p1") == {}
    index.apply(MODEL, 4, "p2", "e1", 0, [], leases_pinned=[lease("L2", far)])
    clock[0] += 11
    assert ("m", "p2") in index.reap()
    assert lease_keys(redis_client) == []


def test_expired_and_malformed_leases_are_not_held(redis_client):
    index = PrefixIndex(redis_client)
    index.apply(MODEL, 4, "p1", "e1", 0, [], leases_pinned=[
        lease("old", time.time() - 1), lease("", time.time() + 30),
        lease("nan", float("nan")), lease("inf", float("inf"))])
    assert index.leases(MODEL, 4, "p1") == {}
    assert index.list_instances(MODEL, 4)[0].num_leases == 0
