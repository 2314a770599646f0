"""The Responses API's stores: the in-process LRU, and the shared one in Redis behind the
kv-cache-manager, which two gateways (two stubs here) read and write alike."""

import asyncio

import grpc
import pytest
from grpc_servers import start_grpc_server

from pagoda.services._proto.pagoda.kv_cache_manager.v1 import kv_cache_manager_pb2_grpc as pb_grpc
from pagoda.services.gateway.errors import APIError
from pagoda.services.gateway.openai.responses_api.store import (MemoryResponseStore,
                                                                SharedResponseStore,
                                                                StoredResponse)
from pagoda.services.kv_cache_manager.index import PrefixIndex
from pagoda.services.kv_cache_manager.response_store import KEY_PREFIX, RedisResponseStore
from pagoda.services.kv_cache_manager.servicer import KvCacheManagerServicer


def item(n: int, size: int = 0) -> StoredResponse:
    return StoredResponse({"id": f"resp_{n}"}, [{"role": "user", "content": str(n) + "x" * size}])


def run(coro):
    return asyncio.run(coro)


def test_the_least_recently_used_response_is_dropped_first():
    async def scenario():
        store = MemoryResponseStore(capacity=2)
        await store.put("a", item(1))
        await store.put("b", item(2))
        assert (await store.get("a")).response == {"id": "resp_1"}  # a: now the most recent
        await store.put("c", item(3))
        assert await store.get("b") is None and await store.get("a") and await store.get("c")
        assert len(store) == 2
        assert await store.delete("a") and not await store.delete("a")
        assert await store.get("a") is None
    run(scenario())


def test_capacity_zero_stores_nothing_and_negative_is_refused():
    async def scenario():
        store = MemoryResponseStore(capacity=0)
        await store.put("a", item(1))
        assert not store.enabled and await store.get("a") is None and len(store) == 0
    run(scenario())
    with pytest.raises(ValueError):
        MemoryResponseStore(capacity=-1)


@pytest.fixture
def kv_cache_manager(redis_client):
    """A kv-cache-manager servicer over the real Redis: (its address, the Redis client)."""
    servicer = KvCacheManagerServicer(PrefixIndex(redis_client),
                                      responses=RedisResponseStore(redis_client, max_bytes=4096))
    server, address = start_grpc_server(pb_grpc.add_KvCacheManagerServiceServicer_to_server,
                                        servicer)
    yield address, redis_client
    server.stop(None)


def test_a_response_stored_by_one_gateway_is_read_and_deleted_by_another(kv_cache_manager):
    address, redis_client = kv_cache_manager

    async def scenario():
        async with grpc.aio.insecure_channel(address) as one, \
                grpc.aio.insecure_channel(address) as two:
            first = SharedResponseStore(pb_grpc.KvCacheManagerServiceStub(one), ttl_s=60)
            second = SharedResponseStore(pb_grpc.KvCacheManagerServiceStub(two), ttl_s=60)
            await first.put("resp_1", item(1))
            got = await second.get("resp_1")
            assert got.response == {"id": "resp_1"} and got.messages[0]["content"] == "1"
            assert 0 < redis_client.ttl(KEY_PREFIX + "resp_1") <= 60  # it expires
            assert await second.get("resp_2") is None
            assert await second.delete("resp_1") and await first.get("resp_1") is None
            assert not await first.delete("resp_1")
            # Over the gateway's cap: not stored (the answer itself is not lost).
            small = SharedResponseStore(pb_grpc.KvCacheManagerServiceStub(one), max_bytes=100)
            await small.put("resp_big", item(3, size=200))
            assert await first.get("resp_big") is None
            # Over the manager's own cap (4096 here): refused there, not stored either.
            await first.put("resp_huge", item(4, size=5000))
            assert await first.get("resp_huge") is None
            disabled = SharedResponseStore(pb_grpc.KvCacheManagerServiceStub(one), enabled=False)
            await disabled.put("resp_off", item(5))
            assert await first.get("resp_off") is None
    run(scenario())


def test_an_unreachable_store_is_a_503_for_a_lookup_and_no_failure_for_a_write():
    async def scenario():
        async with grpc.aio.insecure_channel("127.0.0.1:1") as channel:
            store = SharedResponseStore(pb_grpc.KvCacheManagerServiceStub(channel))
            await store.put("resp_1", item(1))  # a warning, the answer goes out anyway
            with pytest.raises(APIError) as caught:
                await store.get("resp_1")
            assert caught.value.status == 503
    run(scenario())


def test_the_manager_clamps_the_ttl_and_refuses_bad_ids(redis_client):
    store = RedisResponseStore(redis_client, max_ttl_s=100)
    store.put("resp_x", b"{}", 10**9)
    assert 0 < redis_client.ttl(KEY_PREFIX + "resp_x") <= 100
    with pytest.raises(ValueError):
        store.get("")
