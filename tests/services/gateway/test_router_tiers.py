"""kv_aware routing counts a replica's host- or disk-tier hit below a device hit and
above a recompute (`--kv-medium-weights`)."""

from __future__ import annotations

import asyncio
import random

import pytest

from pagoda.core.block_hash import hash_request_tokens
from pagoda.core.kv_events import BlockRemoved, BlockStored
from pagoda.core.kv_offload import KVOffloadIndex
from pagoda.services._proto.pagoda.kv_cache_manager.v1 import kv_cache_manager_pb2_grpc as pb_grpc
from pagoda.services.common.protocol.kv_events import publish_request
from pagoda.services.gateway.routing.prefix_index import PrefixIndexClient
from pagoda.services.gateway.routing.router import (Router, RouteRequest, kv_cost,
                                                    parse_medium_weights,
                                                    weighted_cached_tokens)
from pagoda.services.kv_cache_manager.index import PrefixIndex
from pagoda.services.kv_cache_manager.servicer import KvCacheManagerServicer
from test_router import BLOCK, FakeIndex, FakeReplica

PROMPT = list(range(500, 500 + 8 * BLOCK + 1))  # 8 full blocks and the token to sample from


def test_a_tier_token_is_worth_its_weight_and_the_prompt_caps_the_run():
    w = {"CPU": 0.8, "DISK": 0.5}
    assert weighted_cached_tokens(len(PROMPT), 8, 0, 0, BLOCK, w) == 8 * BLOCK
    assert weighted_cached_tokens(len(PROMPT), 2, 6, 0, BLOCK, w) == (2 + 0.8 * 6) * BLOCK
    assert weighted_cached_tokens(len(PROMPT), 2, 3, 3, BLOCK, w) == (2 + 2.4 + 1.5) * BLOCK
    # The last prompt token is always computed: a 9th block never counts, host first.
    assert weighted_cached_tokens(len(PROMPT) - 1, 2, 3, 3, BLOCK, w) == (2 + 2.4 + 1) * BLOCK
    device, host, disk, cold = (kv_cost(FakeReplica(str(i)), len(PROMPT), *blocks, weights=w)
                                for i, blocks in enumerate([(8, 0.0, 0, 0), (0, 0.0, 8, 0),
                                                            (0, 0.0, 0, 8), (0, 0.0, 0, 0)]))
    assert device < host < disk < cold


def test_kv_aware_prefers_device_then_host_tier_then_disk_tier_then_nothing():
    a, b, c, d = (FakeReplica(str(i)) for i in range(1, 5))
    tiers = {"sched-2": (8, 0), "sched-3": (0, 8)}
    req = RouteRequest(PROMPT, len(PROMPT))

    def pick(replicas, weights=None):
        router = Router("kv_aware", FakeIndex({"sched-1": 8}, tiers), random.Random(0),
                        weights)
        return asyncio.run(router.route(replicas, req, object()))

    assert pick([a, b, c, d]).replica is a
    second = pick([b, c, d])
    assert second.replica is b and second.predicted_cached_tokens == 8 * BLOCK
    assert second.prefix.tier_blocks["sched-2"] == (8, 0)
    second.release()
    assert pick([c, d]).replica is c
    # Weighed as a recompute (weight 0), a tier hit no longer outweighs load.
    c.reported = 1
    assert pick([c, d], {"CPU": 0.0, "DISK": 0.0}).replica is d
    assert pick([c, d]).replica is c


def test_the_flag_is_checked():
    assert parse_medium_weights('{"CPU": 0.9, "GPU": 1}') == {"CPU": 0.9}
    for bad, word in [('{"CPU": 2}', "CPU"), ('{"NVME": 0.5}', "NVME"), ("[1]", "object"),
                      ("{", "JSON"), ('{"DISK": true}', "DISK")]:
        with pytest.raises(ValueError, match=word):
            parse_medium_weights(bad)


def test_replicas_publish_through_a_real_index_and_the_router_ranks_them(
        redis_client, grpc_server_factory):
    """A holds the prefix on its device, B evicted it into its host tier (its real
    tier index's events), C holds nothing: A, then B, then C."""
    served = grpc_server_factory(pb_grpc.add_KvCacheManagerServiceServicer_to_server,
                                 KvCacheManagerServicer(PrefixIndex(redis_client)))
    stub = pb_grpc.KvCacheManagerServiceStub(served.channel)
    h = hash_request_tokens(PROMPT, BLOCK, "seed")
    assert len(h) == 8
    stored = BlockStored(h, None, PROMPT[:8 * BLOCK], BLOCK)
    stub.PublishKvEvents(publish_request("sched-1", "m", BLOCK, "e", 0, [stored]))
    tier = KVOffloadIndex(16, 100)
    for i, block_hash in enumerate(h):  # B's device evicts every block into its tier
        tier.offload(i, block_hash, tuple(PROMPT[i * BLOCK:(i + 1) * BLOCK]))
    tier.take_ops()
    events = [stored, BlockRemoved(h), *tier.take_events(BLOCK)]
    stub.PublishKvEvents(publish_request("sched-2", "m", BLOCK, "e", 0, events))
    stub.PublishKvEvents(publish_request("sched-3", "m", BLOCK, "e", 0, []))
    a, b, c = FakeReplica("1"), FakeReplica("2"), FakeReplica("3")
    req = RouteRequest(PROMPT, len(PROMPT), block_hashes=h)

    async def run():
        router = Router("kv_aware", PrefixIndexClient(served.address), random.Random(0))
        found = await router.index.lookup(None, PROMPT, h, "", "m", BLOCK)
        picks = [(await router.route([a, b, c], req, object())).replica,
                 (await router.route([b, c], req, object())).replica]
        # Without the tiers' weight B and C would tie; now B wins even with more load.
        b.reported = 1
        picks.append((await router.route([b, c], req, object())).replica)
        await router.close()
        return found, picks

    found, picks = asyncio.run(run())
    assert found[1:] == ({"sched-1": 8}, {"sched-2": (8, 0)})
    assert picks == [a, b, b]
