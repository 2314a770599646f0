"""Pick a pool member for one request with Pagoda's own router.

The candidates are the routable scheduler replicas (the gateway's `Peers`: health,
model info, load from GetLoad, the block-hash check), narrowed to the proxy's subset
hint when it sent one, and to the replicas holding or able to load the request's LoRA
adapter (the router's `AdapterPlacement`). The router (kv_aware by default: cached
prefix from the kv-cache-manager's index against live load) chooses among them, as
Pagoda's gateway would for the same body.

Shedding follows GIE's saturation detector: a replica is saturated when its queue
holds `queue_depth_threshold` requests or more, its KV cache is at least
`kv_cache_util_threshold` full, or its load is unknown (stale); a sheddable request
(its InferenceObjective's priority below 0) is refused with 429 when every candidate
is saturated. Invariant: `pick` returns a reserved `Route` (released by the caller
when the HTTP exchange ends) or raises `PickError` with the HTTP status for the proxy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc

from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as tpb
from pagoda.services.epp.body import ParsedBody
from pagoda.services.epp.endpoints import EndpointResolver
from pagoda.services.gateway.errors import APIError
from pagoda.services.gateway.routing.peers import Peers
from pagoda.services.gateway.routing.router import Route, RouteRequest

TOKENIZE_TIMEOUT_S = 5.0
MAX_FALLBACKS = 2  # endpoints after the chosen one in x-gateway-destination-endpoint


class PickError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class SaturationThresholds:
    queue_depth: int = 5      # GIE's default QueueDepthThreshold
    kv_cache_util: float = 0.8  # GIE's default KVCacheUtilThreshold

    def saturated(self, replica) -> bool:
        load = replica.load
        return (load is None or load.num_waiting >= self.queue_depth
                or load.kv_cache_usage >= self.kv_cache_util)


@dataclass
class Pick:
    route: Route
    endpoints: list[str]  # the chosen one first, then fallbacks

    @property
    def endpoint(self) -> str:
        return self.endpoints[0]


class Picker:
    def __init__(self, peers: Peers, resolver: EndpointResolver,
                 thresholds: SaturationThresholds) -> None:
        self.peers = peers
        self.resolver = resolver
        self.thresholds = thresholds

    def ready_replicas(self) -> list:
        return [r for r in self.peers.schedulers if r.is_routable()]

    async def pick(self, body: ParsedBody, subset: list[str] | None, sheddable: bool) -> Pick:
        candidates = self.ready_replicas()
        if subset is not None:
            allowed = set(subset)
            candidates = [r for r in candidates if self.resolver.endpoint(r) in allowed]
        if not candidates:
            raise PickError(503, "No ready endpoint in the pool" +
                            (" among the subset hint." if subset is not None else "."))
        if sheddable and all(self.thresholds.saturated(r) for r in candidates):
            raise PickError(429, "Every endpoint is saturated; the sheddable request is "
                                 "dropped.")
        adapter = self._adapter(body.model)
        if adapter:
            candidates = self.peers.router.adapters.candidates(candidates, adapter)
        request = await self._route_request(body)
        try:
            route = await self.peers.router.route(candidates, request, self.peers.tokenizer.stub)
        except APIError as exc:
            raise PickError(exc.status, exc.message) from None
        if adapter:
            self.peers.router.adapters.record(route.replica.address, adapter, time.monotonic())
        chosen = self.resolver.endpoint(route.replica)
        others = sorted((r for r in candidates if r is not route.replica),
                        key=lambda r: (r.num_requests(), r.num_pending_tokens))
        fallbacks = [self.resolver.endpoint(r) for r in others[:MAX_FALLBACKS]]
        return Pick(route, [chosen, *[e for e in fallbacks if e != chosen]])

    def _adapter(self, model: str) -> str | None:
        """The LoRA adapter a request names as its `model` (None: the base model)."""
        if not model:
            return None
        try:
            info = self.peers.model_info()
        except APIError:
            return None
        names = set(info.served_model_name) | {info.model}
        return None if model in names else model

    async def _route_request(self, body: ParsedBody) -> RouteRequest:
        """The router's view of the body: the first prompt's tokens and block hashes
        (from the tokenizer, with the replicas' block size when the index is used)."""
        tokenize = tpb.TokenizeRequest()
        tokenize.CopyFrom(body.tokenize)
        tokenize.block_size = self.peers.routing_block_size()
        tokenize.cache_salt = body.cache_salt
        try:
            reply = await self.peers.tokenizer.stub.Tokenize(tokenize, timeout=TOKENIZE_TIMEOUT_S)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise PickError(400, exc.details() or "The prompt could not be tokenized.")
            raise PickError(503, f"The tokenizer is unavailable: {exc.details()}") from None
        token_ids = list(reply.token_ids) or list(body.tokenize.token_ids.token_ids)
        hashes = list(reply.block_hashes) if tokenize.block_size else None
        return RouteRequest(token_ids, len(token_ids) * body.num_prompts, body.num_prompts,
                            body.cache_salt, body.user, hashes)
