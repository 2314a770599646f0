"""The routing policies' choices, on replicas whose load and cache the test sets."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from types import SimpleNamespace

import pytest

from pagoda.core.block_hash import hash_request_tokens
from pagoda.services.gateway.routing.router import Router, RouteRequest, usable_cached_tokens

BLOCK = 16


class FakeReplica:
    """What the router reads of a SchedulerReplica."""

    def __init__(self, name: str, reported: int = 0) -> None:
        self.address = f"10.0.0.{name}:50052"
        self.instance_id = f"sched-{name}"
        self.info = SimpleNamespace(block_size=BLOCK, model="m", instance_id=self.instance_id)
        self.routable = True
        self.reported = reported  # running + waiting it last reported
        self.num_in_flight = 0
        self.num_pending_tokens = 0

    def is_routable(self) -> bool:
        return self.routable

    def num_requests(self) -> int:
        return max(self.num_in_flight, self.reported)


class FakeIndex:
    """The prefix index: instance id -> cached leading blocks (and, past them, host-
    and disk-tier blocks), or down (None)."""

    def __init__(self, blocks: dict[str, int] | None,
                 tiers: dict[str, tuple[int, int]] | None = None) -> None:
        self.blocks = blocks
        self.tiers = tiers or {}
        self.calls = 0

    async def lookup(self, tokenizer_stub, token_ids, block_hashes, cache_salt, model,
                     block_size, lora_key=""):
        self.calls += 1
        if self.blocks is None:
            return None
        return (hash_request_tokens(token_ids, block_size, "seed"), dict(self.blocks),
                dict(self.tiers))


PROMPT = list(range(1000, 1000 + 32 * BLOCK + 5))  # 32 full blocks and a bit


def request(prompt=PROMPT, session=None) -> RouteRequest:
    return RouteRequest(prompt, len(prompt), 1, "", session)


def route(router, replicas, req=None, exclude=frozenset()):
    return asyncio.run(router.route(replicas, req or request(), object(), exclude))


def test_kv_aware_sends_a_prompt_where_its_prefix_is_cached():
    a, b = FakeReplica("1"), FakeReplica("2")
    router = Router("kv_aware", FakeIndex({"sched-2": 30}), random.Random(0))
    chosen = route(router, [a, b])
    assert chosen.replica is b and chosen.predicted_cached_tokens == 30 * BLOCK
    # Its load is reserved at once: the next route sees it.
    assert b.num_in_flight == 1 and b.num_pending_tokens == len(PROMPT) - 30 * BLOCK
    chosen.prefill_done()
    assert b.num_pending_tokens == 0 and b.num_in_flight == 1
    chosen.release()
    chosen.release()  # idempotent
    assert b.num_in_flight == 0


def test_a_burst_on_one_prefix_spills_over_instead_of_piling_up():
    a, b = FakeReplica("1"), FakeReplica("2")
    router = Router("kv_aware", FakeIndex({"sched-1": 32}), random.Random(0))
    picks = [route(router, [a, b]).replica for _ in range(12)]  # none released: in flight
    # A holds the prefix, so it takes the first ones; then its queue and its share of
    # the recent requests outweigh the prefill it saves, and B takes its part.
    assert picks[:2] == [a, a]
    assert 4 <= picks.count(b) <= picks.count(a) <= 8


def test_new_prefixes_go_where_fewer_requests_went_lately():
    a, b = FakeReplica("1"), FakeReplica("2")
    router = Router("kv_aware", FakeIndex({}), random.Random(0))
    for _ in range(6):  # A served a run of cache hits: cheap, done, nothing in flight
        route(router, [a], request([7] * 3 * BLOCK)).release()
    picks = []
    for i in range(3):  # equal live load: only the recent shares differ
        chosen = route(router, [a, b], request([i] * 3 * BLOCK))
        picks.append(chosen.replica)
        chosen.release()
    assert picks == [b, b, b]


def test_live_load_outweighs_a_small_cached_prefix():
    a, b = FakeReplica("1", reported=20), FakeReplica("2")
    router = Router("kv_aware", FakeIndex({"sched-1": 2}), random.Random(0))
    assert route(router, [a, b]).replica is b


def test_ties_are_broken_at_random():
    replicas = [FakeReplica(str(i)) for i in range(3)]
    router = Router("kv_aware", FakeIndex({}), random.Random(1))
    counts = Counter()
    for i in range(60):
        chosen = route(router, replicas, request([i] * 3 * BLOCK))  # a new prefix each time
        counts[chosen.replica.address] += 1
        chosen.release()  # keep loads equal: every route is a tie
    assert len(counts) == 3 and min(counts.values()) >= 8


def test_without_the_index_kv_aware_routes_by_load():
    a, b = FakeReplica("1", reported=3), FakeReplica("2", reported=1)
    index = FakeIndex(None)  # Redis or the kv-cache-manager is down
    router = Router("kv_aware", index, random.Random(0))
    chosen = route(router, [a, b])
    assert chosen.replica is b and chosen.predicted_cached_tokens is None and index.calls == 1


def test_one_candidate_is_routed_without_asking_the_index():
    # Issue 28: the lookup (and the block hashes the tokenizer computes for it) cost each
    # request ~1 ms of CPU and cannot change a forced choice.
    a, b = FakeReplica("1"), FakeReplica("2")
    index = FakeIndex({"sched-1": 30})
    router = Router("kv_aware", index, random.Random(0))
    chosen = route(router, [a])
    assert chosen.replica is a and chosen.predicted_cached_tokens is None
    assert chosen.prefix is None and index.calls == 0
    assert a.num_pending_tokens == len(PROMPT)  # nothing predicted cached
    chosen.release()
    route(router, [a, b], exclude=frozenset({b.address})).release()  # one left: forced too
    assert index.calls == 0
    assert route(router, [a, b]).predicted_cached_tokens == 30 * BLOCK and index.calls == 1
    router.lookup_single_replica = True  # --kv-prefix-pull reads the lookup
    assert route(router, [a]).prefix is not None and index.calls == 2


def test_recent_routes_cover_the_index_lag():
    a, b = FakeReplica("1"), FakeReplica("2")
    index = FakeIndex({})  # the index has not seen the first request's blocks yet
    router = Router("kv_aware", index, random.Random(0))
    first = route(router, [a, b])
    first.release()
    for _ in range(3):  # (more would tip the herding guard: see the burst test)
        again = route(router, [a, b])
        assert again.replica is first.replica
        assert again.predicted_cached_tokens == usable_cached_tokens(len(PROMPT), 32, BLOCK)
        again.release()


def test_unroutable_and_excluded_replicas_are_skipped():
    a, b, c = FakeReplica("1"), FakeReplica("2"), FakeReplica("3")
    b.routable = False
    router = Router("kv_aware", FakeIndex({"sched-2": 32, "sched-3": 32}), random.Random(0))
    assert route(router, [a, b, c], exclude=frozenset({c.address})).replica is a
    with pytest.raises(Exception) as info:
        route(router, [b])
    assert getattr(info.value, "status", None) == 503


def test_least_loaded_and_round_robin():
    a, b = FakeReplica("1", reported=4), FakeReplica("2", reported=2)
    assert route(Router("least_loaded"), [a, b]).replica is b
    router = Router("round_robin")
    picks = [route(router, [a, b]).replica for _ in range(4)]
    assert picks == [a, b, a, b]


def test_session_routing_is_sticky_and_moves_only_the_leavers_sessions():
    replicas = [FakeReplica(str(i)) for i in range(4)]
    router = Router("session", rng=random.Random(0))
    before = {s: route(router, replicas, request(session=s)).replica for s in map(str, range(40))}
    assert len(set(before.values())) == 4  # sessions spread over the replicas
    assert all(route(router, replicas, request(session=s)).replica is r for s, r in before.items())
    gone = replicas[0]
    gone.routable = False
    for s, r in before.items():
        after = route(router, replicas, request(session=s)).replica
        assert after is not gone and (r is gone or after is r)


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError):
        Router("random")
