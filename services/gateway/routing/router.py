"""Which scheduler replica serves a request: `--router round_robin|least_loaded|kv_aware|session`.

kv_aware (the default) picks the replica with the lowest cost, in tokens of work:

    cost(r) = prompt tokens - tokens r holds cached              # prefill r would do
              + (1 - w_M) x tokens r holds in its tier M         # onload instead of prefill
            + PENDING_WEIGHT x prefill tokens queued on r       # live load, tokens
            + REQUEST_COST_TOKENS x requests on r               # live load, requests
            + prompt tokens x excess_share(r) / IMBALANCE_TOLERANCE   # herding guard

A tier hit counts below a device hit and above recompute: past its device hits, a
replica's index entry may hold the prompt's next blocks in its host tier (medium
"CPU") or disk tier ("DISK"), which its scheduler onloads instead of computing. Such
a token saves w_M of a cached token (`--kv-medium-weights`, default CPU 0.8, DISK
0.5; see DEFAULT_MEDIUM_WEIGHTS for why).

Cached tokens come from the cluster prefix index (prefix_index.py), looked up
with the block hashes the tokenizer returned with the prompt's tokens, and bridged
by the routes this gateway made in the last seconds. Requests on r are the larger of
what this gateway has in flight there (counted the moment it routes, so a burst
sees its own earlier picks) and what r last reported (GetLoad: every gateway's).
Queued prefill counts below one (PENDING_WEIGHT): the scheduler batches queued
prefills together, so they delay a newcomer less than its own prefill would.

The herding guard: a replica that holds popular prefixes serves cheap cache hits,
so it looks lightly loaded and would attract ever more new prefixes too, until
it holds more than its cache fits. `excess_share(r)` is how far r's share of
recently routed requests (decayed over RECENT_TAU_S) is above the fair share,
relative to it; at IMBALANCE_TOLERANCE (30% above fair) it outweighs a whole
cached prompt. So new prefixes go where fewer requests went lately, and a
prefix stays where it is cached until its replica is clearly over its share.
Ties are broken at random. Without the index (Redis or the kv-cache-manager
down) the cached term is 0 for all: load-based routing. With one candidate replica
the index is not asked (nor are block hashes computed for it): it could not change
the choice; a route then predicts no cached tokens (`Route.prefix` is None).

least_loaded: fewest requests, then fewest pending tokens. session: the same
session (the `X-Session-Id` header, else the body's `user`) always lands on the
same replica while it serves (rendezvous hashing, so a replica leaving moves
only its own sessions); no session: least-loaded. round_robin: in turn.

The constants were chosen with `pagoda bench routing` (16 prefixes x 4 users,
2 replicas each caching about half): see the gateway README.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagoda.lora.request import LoRARequest
from pagoda.services.gateway.errors import APIError
from pagoda.services.gateway.routing.lora_placement import AdapterPlacement
from pagoda.services.gateway.routing.prefix_index import PrefixIndexClient, RecentRoutes

POLICIES = ("round_robin", "least_loaded", "kv_aware", "session")
DEFAULT_POLICY = "kv_aware"
# What one request in progress costs a replica, in prefill-token equivalents: its
# decode steps share the batch with everyone else's prefill.
REQUEST_COST_TOKENS = 64
PENDING_WEIGHT = 0.25  # per queued prefill token (batched with ours, so below 1)
IMBALANCE_TOLERANCE = 0.3  # share above fair at which a whole cached prompt is outweighed
RECENT_TAU_S = 5.0  # decay of the recent-requests count
RECENT_PRIOR = 4.0  # requests added to every count: keeps shares calm while traffic is light
# What a token in a replica's host ("CPU") / disk ("DISK") tier is worth against one in
# its KV cache (1.0; recomputing is 0). Measured here (libs/pagoda/README.md, KV tiers:
# 737 KiB blocks on the CPU box) an onload costs 2.5 ms a block from the host tier and
# 1.6 ms from a page-cached disk against 108 ms to recompute, i.e. 0.98 of a device hit;
# projected for an 8B model on a GPU host the host tier keeps 0.87 (0.084 vs 0.64 ms)
# and an NVMe 0.41 (0.38 ms). The onload is also synchronous in the step (it delays the
# batch, a device hit does not), so the defaults sit below those: 0.8 and 0.5. That
# keeps a device hit strictly preferred and a tier hit far above a cold replica.
DEFAULT_MEDIUM_WEIGHTS = {"CPU": 0.8, "DISK": 0.5}


@dataclass
class RouteRequest:
    """What the router needs of one HTTP request (all its choices go to one replica)."""

    prompt_token_ids: Sequence[int]  # the first prompt: prefix affinity
    num_prompt_tokens: int           # every choice's prompt: load
    num_requests: int = 1
    cache_salt: str = ""
    session_key: str | None = None
    # The first prompt's block hashes from its tokenization; None for a prompt sent
    # as token ids (the index client then hashes it when it needs the hashes).
    block_hashes: Sequence[bytes] | None = None
    # The LoRA adapter it runs with (lora_placement.py prefers replicas holding it).
    lora_request: LoRARequest | None = None

    @property
    def lora_key(self) -> str:
        return self.lora_request.cache_key if self.lora_request else ""


@dataclass
class PrefixLookup:
    """What the prefix index said of a routed prompt: its block hashes and, per
    instance id, the leading blocks it holds (the index and recent routes)."""

    block_hashes: list[bytes]
    cached_blocks: dict[str, int]  # in the KV cache (what a prefix pull can read)
    # instance id -> (host-tier, disk-tier) blocks of the run after its cached ones
    tier_blocks: dict[str, tuple[int, int]] = field(default_factory=dict)
    medium_weights: dict[str, float] = field(default_factory=lambda: DEFAULT_MEDIUM_WEIGHTS)


@dataclass
class Route:
    """A replica chosen for a request, and the load reserved on it until `release`."""

    replica: object  # peers.SchedulerReplica
    policy: str
    predicted_cached_tokens: int | None = None  # None: the index was not asked
    pending_tokens: int = 0
    num_requests: int = 1
    prefix: PrefixLookup | None = None  # None: the index was not asked or did not answer
    _released: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        self.replica.num_in_flight += self.num_requests
        self.replica.num_pending_tokens += self.pending_tokens

    def prefill_done(self) -> None:
        """The first output arrived: its prompt no longer waits for prefill."""
        self.replica.num_pending_tokens -= self.pending_tokens
        self.pending_tokens = 0

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.prefill_done()
            self.replica.num_in_flight -= self.num_requests


class Router:
    """Invariant: `route` returns a replica that was routable when the route began
    (one that stopped serving during the index lookup is skipped unless none is
    left: the retry in dispatch.py covers it), and reserves its load before
    returning (no await between the choice and the reservation), so concurrent
    routes see each other."""

    def __init__(self, policy: str = DEFAULT_POLICY, index: PrefixIndexClient | None = None,
                 rng: random.Random | None = None,
                 medium_weights: dict[str, float] | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown router {policy!r}; choose from {', '.join(POLICIES)}")
        self.policy = policy
        self.medium_weights = {**DEFAULT_MEDIUM_WEIGHTS, **(medium_weights or {})}
        self.index = index
        # With one replica to choose from the index cannot change the choice, so it is
        # not asked (issue 28: a LookupPrefix, and the block hashes the tokenizer computes
        # for it, were ~1 ms of CPU per request across gateway, tokenizer, kv-cache-manager
        # and Redis). True where something else reads the lookup (--kv-prefix-pull).
        self.lookup_single_replica = False
        self.recent_routes = RecentRoutes()
        self.adapters = AdapterPlacement()
        self.rng = rng or random.Random()
        self._turn = itertools.count()
        self._recent_counts: dict[str, tuple[float, float]] = {}  # address -> (count, when)

    async def route(self, replicas: Sequence, request: RouteRequest, tokenizer_stub=None,
                    exclude: frozenset[str] = frozenset()) -> Route:
        """Pick a replica among `replicas` (SchedulerReplica) minus `exclude` (addresses);
        503 if none can take the request."""
        live = [r for r in replicas if r.is_routable() and r.address not in exclude]
        if not live:
            raise APIError("No scheduler replica is available.", 503)
        adapter = request.lora_request.lora_name if request.lora_request else None
        if adapter:
            live = self.adapters.candidates(live, adapter)
        cached, tiers, hashes = {}, {}, None
        if self.index is not None and tokenizer_stub is not None and (
                len(live) > 1 or self.lookup_single_replica):
            cached, tiers, hashes = await self._cached_tokens(live, request, tokenizer_stub)
            live = [r for r in live if r.is_routable()] or live  # the await let time pass
        chosen = self._choose(live, request, cached, tiers)
        if adapter:
            self.adapters.record(chosen.address, adapter)
        block_size = chosen.info.block_size
        predicted = None
        if hashes is not None:
            # Onloaded tier blocks are not prefilled either.
            predicted = usable_cached_tokens(
                len(request.prompt_token_ids),
                cached.get(chosen.instance_id, 0) + sum(tiers.get(chosen.instance_id, (0, 0))),
                block_size)
            self.recent_routes.record(hashes, chosen.instance_id, time.monotonic())
        pending = max(0, request.num_prompt_tokens - (predicted or 0) * request.num_requests)
        now = time.monotonic()
        self._recent_counts[chosen.address] = (self.recent_requests(chosen.address, now) + 1.0,
                                               now)
        prefix = (PrefixLookup(hashes, cached, tiers, self.medium_weights) if hashes is not None
                  else None)
        return Route(chosen, self.policy, predicted, pending, request.num_requests, prefix)

    def recent_requests(self, address: str, now: float) -> float:
        """Requests routed to `address` lately, each decayed by exp(-age / RECENT_TAU_S)."""
        count, at = self._recent_counts.get(address, (0.0, now))
        return count * math.exp(-(now - at) / RECENT_TAU_S)

    def excess_share(self, live: list, now: float) -> dict[str, float]:
        """address -> how far its recent share is above the fair one (0 if not above)."""
        recent = {r.address: self.recent_requests(r.address, now) + RECENT_PRIOR for r in live}
        fair = sum(recent.values()) / len(recent)
        return {address: max(0.0, n / fair - 1.0) for address, n in recent.items()}

    def _choose(self, live: list, request: RouteRequest, cached: dict[str, int],
                tiers: dict[str, tuple[int, int]]):
        if self.policy == "round_robin":
            ordered = sorted(live, key=lambda r: r.address)
            return ordered[next(self._turn) % len(ordered)]
        if self.policy == "session" and request.session_key:
            return max(live, key=lambda r: _rendezvous(request.session_key, r.address))
        if self.policy == "kv_aware":
            prompt_len = len(request.prompt_token_ids)
            excess = self.excess_share(live, time.monotonic())
            costs = {r.address: kv_cost(r, prompt_len, cached.get(r.instance_id, 0),
                                        excess[r.address], *tiers.get(r.instance_id, (0, 0)),
                                        weights=self.medium_weights) for r in live}
            best = min(costs.values())
            return self.rng.choice([r for r in live if costs[r.address] == best])
        key = {r.address: (r.num_requests(), r.num_pending_tokens) for r in live}
        best = min(key.values())
        return self.rng.choice([r for r in live if key[r.address] == best])

    async def _cached_tokens(self, live: list, request: RouteRequest, tokenizer_stub
                             ) -> tuple[dict[str, int], dict[str, tuple[int, int]],
                                        list[bytes] | None]:
        """instance id -> cached leading blocks (index and recent routes), instance id
        -> (host, disk) tier blocks after them, and the prompt's block hashes (None
        when the index could not be asked)."""
        info = live[0].info  # one model and block size per cluster (the chart sets both once)
        found = await self.index.lookup(tokenizer_stub, request.prompt_token_ids,
                                        request.block_hashes, request.cache_salt, info.model,
                                        info.block_size, request.lora_key)
        if found is None:
            return {}, {}, None
        hashes, blocks, tiers = found
        for instance, n in self.recent_routes.cached_blocks(hashes, time.monotonic()).items():
            device = blocks.get(instance, 0)
            if n <= device:
                continue
            blocks[instance] = n  # routed there lately: its prefill puts them on the device
            host, disk = tiers.get(instance, (0, 0))
            rest = max(0, device + host + disk - n)  # the tier run beyond them, host first
            if (host, disk) != (0, 0):
                tiers[instance] = (min(host, rest), rest - min(host, rest))
        return blocks, tiers, hashes

    async def close(self) -> None:
        if self.index is not None:
            await self.index.close()


def kv_cost(replica, prompt_len: int, cached_blocks: int, excess_share: float = 0.0,
            host_blocks: int = 0, disk_blocks: int = 0,
            weights: dict[str, float] = DEFAULT_MEDIUM_WEIGHTS) -> float:
    """The kv_aware cost of sending a prompt to `replica` (see the module docstring)."""
    cached = weighted_cached_tokens(prompt_len, cached_blocks, host_blocks, disk_blocks,
                                    replica.info.block_size, weights)
    return (prompt_len - cached + PENDING_WEIGHT * replica.num_pending_tokens
            + REQUEST_COST_TOKENS * replica.num_requests()
            + prompt_len * excess_share / IMBALANCE_TOLERANCE)


def usable_cached_tokens(prompt_len: int, cached_blocks: int, block_size: int) -> int:
    """Tokens a scheduler can take from its cache: whole blocks, never the prompt's
    last token (it must be computed to sample the first output)."""
    return min(cached_blocks, (prompt_len - 1) // block_size) * block_size


def weighted_cached_tokens(prompt_len: int, device_blocks: int, host_blocks: int,
                           disk_blocks: int, block_size: int,
                           weights: dict[str, float] = DEFAULT_MEDIUM_WEIGHTS) -> float:
    """Prefill tokens a replica saves, in device-hit tokens: its usable leading run
    (usable_cached_tokens) taken from the device first, then the host tier, then the
    disk tier, each tier token counted at its medium's weight."""
    usable = usable_cached_tokens(prompt_len, device_blocks + host_blocks + disk_blocks,
                                  block_size) // block_size
    device = min(device_blocks, usable)
    host = min(host_blocks, usable - device)
    disk = usable - device - host
    return block_size * (device + weights["CPU"] * host + weights["DISK"] * disk)


def parse_medium_weights(text: str) -> dict[str, float]:
    """`--kv-medium-weights` JSON ({"CPU": w, "DISK": w}, each in [0, 1]; "GPU" may be
    given only as 1): the weights, or ValueError naming what is wrong."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--kv-medium-weights: not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError('--kv-medium-weights: not a JSON object such as {"CPU": 0.8}')
    weights = {}
    for medium, weight in raw.items():
        if medium == "GPU" and weight == 1:
            continue
        if medium not in DEFAULT_MEDIUM_WEIGHTS:
            raise ValueError(f"--kv-medium-weights: unknown medium {medium!r} (CPU, DISK; "
                             "GPU is always 1)")
        if (isinstance(weight, bool) or not isinstance(weight, (int, float))
                or not 0 <= weight <= 1):
            raise ValueError(f"--kv-medium-weights: {medium} must be a number in [0, 1], "
                             f"got {weight!r}")
        weights[medium] = float(weight)
    return weights


def _rendezvous(session_key: str, address: str) -> int:
    digest = hashlib.blake2b(f"{session_key}|{address}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
