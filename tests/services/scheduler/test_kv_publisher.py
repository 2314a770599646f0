"""The scheduler's KV event publisher against a real kv-cache-manager servicer and Redis:
batches, heartbeats, resync after lost batches, deregistration."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pagoda.services._proto.pagoda.kv_cache_manager.v1 import kv_cache_manager_pb2_grpc as pb_grpc
from pagoda.core.block_hash import hash_request_tokens
from pagoda.core.kv_events import BlockRemoved, BlockStored
from pagoda.free_ports import free_port
from pagoda.services.kv_cache_manager.index import PrefixIndex
from pagoda.services.kv_cache_manager.servicer import KvCacheManagerServicer
from pagoda.services.scheduler.kv_publisher import KvEventPublisher

MODEL, BLOCK = "m", 4


def wait_until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


class FakeCache:
    """The engine side: what is cached, and a snapshot taken "on the engine thread"."""

    def __init__(self) -> None:
        self.hashes: set[bytes] = set()
        self.snapshots = 0

    def store(self, publisher: KvEventPublisher, hashes: list[bytes]) -> None:
        self.hashes |= set(hashes)
        publisher.publish([BlockStored(hashes, None, list(range(len(hashes) * BLOCK)), BLOCK)])

    def evict(self, publisher: KvEventPublisher, hashes: list[bytes]) -> None:
        self.hashes -= set(hashes)
        publisher.publish([BlockRemoved(hashes)])

    def snapshot_source(self, deliver) -> None:
        self.snapshots += 1
        threading.Thread(target=deliver, args=(sorted(self.hashes),)).start()


@pytest.fixture
def index(redis_client):
    return PrefixIndex(redis_client, heartbeat_timeout=5.0)


@pytest.fixture
def manager(index, grpc_server_factory):
    return grpc_server_factory(pb_grpc.add_KvCacheManagerServiceServicer_to_server,
                               KvCacheManagerServicer(index))


def publisher_for(address: str, cache: FakeCache, epoch: str = "e1") -> KvEventPublisher:
    return KvEventPublisher(address, "s1", MODEL, BLOCK, epoch, interval=0.01,
                            heartbeat_interval=0.1, snapshot_source=cache.snapshot_source).start()


def blocks(seed: int, n: int = 3) -> list[bytes]:
    return hash_request_tokens([seed] * (n * BLOCK), BLOCK, "seed")


def test_events_reach_the_index_and_heartbeats_register_an_idle_instance(index, manager):
    cache = FakeCache()
    publisher = publisher_for(manager.address, cache)
    try:
        assert wait_until(lambda: [i.instance_id for i in index.list_instances(MODEL, BLOCK)]
                          == ["s1"])  # registered before it cached anything
        cache.store(publisher, blocks(1))
        cache.store(publisher, blocks(2))
        cache.evict(publisher, blocks(1)[2:])
        assert wait_until(lambda: index.instance_blocks(MODEL, BLOCK, "s1") == cache.hashes)
        assert cache.snapshots == 0
    finally:
        publisher.stop(deregister=True)
    assert index.list_instances(MODEL, BLOCK) == [] and index.lookup(MODEL, BLOCK, blocks(2)) == {}


def test_a_lost_batch_is_repaired_by_a_snapshot(index, manager):
    cache = FakeCache()
    publisher = publisher_for(manager.address, cache)
    try:
        cache.store(publisher, blocks(1))
        assert wait_until(lambda: index.instance_blocks(MODEL, BLOCK, "s1") == cache.hashes)
        # A batch goes missing on the way (its events never reach the index).
        cache.hashes |= set(blocks(2))
        cache.hashes -= set(blocks(1)[:1])
        publisher.sequence_number += 1
        # The next heartbeat tells the index a batch was sent that it never got.
        assert wait_until(lambda: index.instance_blocks(MODEL, BLOCK, "s1") == cache.hashes)
        assert cache.snapshots == 1 and publisher.num_snapshots_sent == 1
        cache.store(publisher, blocks(3))  # and normal batches apply again on top
        assert wait_until(lambda: index.instance_blocks(MODEL, BLOCK, "s1") == cache.hashes)
    finally:
        publisher.stop()


def test_batches_dropped_while_the_manager_is_down_are_resynced(index):
    cache = FakeCache()
    port = free_port()
    publisher = publisher_for(f"127.0.0.1:{port}", cache)  # nobody listens yet
    try:
        cache.store(publisher, blocks(1))
        assert wait_until(lambda: publisher.num_dropped_batches >= 1)
        server = grpc.server(ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_KvCacheManagerServiceServicer_to_server(KvCacheManagerServicer(index), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        try:
            assert wait_until(lambda: index.instance_blocks(MODEL, BLOCK, "s1") == cache.hashes,
                              timeout=10)
            assert cache.snapshots >= 1
        finally:
            server.stop(None)
    finally:
        publisher.stop()


def test_a_restarted_scheduler_replaces_its_old_entries(index, manager):
    old = FakeCache()
    first = publisher_for(manager.address, old, epoch="e1")
    old.store(first, blocks(1))
    assert wait_until(lambda: index.instance_blocks(MODEL, BLOCK, "s1") == old.hashes)
    first.stop()  # killed: no deregistration
    new = FakeCache()
    second = publisher_for(manager.address, new, epoch="e2")
    try:
        new.store(second, blocks(2))
        assert wait_until(lambda: index.instance_blocks(MODEL, BLOCK, "s1") == new.hashes)
        assert new.snapshots == 0  # a new epoch starting at batch 0 needs no snapshot
    finally:
        second.stop()
