"""Route one request's scheduler streams, retrying elsewhere while that is safe.

A replica may refuse a request before producing anything: it is draining
(SIGTERM), its queue is full, it just died, or the connection failed. Nothing
reached the client then, so the request goes to another replica (at most
`MAX_ATTEMPTS` in all); once a delta went out, a failure is the client's error.
When no replica is routable at all, the request waits up to ROUTE_WAIT_S for the
poller to make one routable (a rollout) before its 503.
The routing metrics are counted here: the decision (policy, instance) and, when
the prefix index was asked, the cached tokens it predicted for the chosen
replica against those the replica reported for the first choice.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence

from pagoda.messages import EngineCoreRequest
from pagoda.services.gateway.errors import APIError
from pagoda.services.gateway.observability.metrics import gateway_metrics
from pagoda.services.gateway.routing import context as router_context
from pagoda.services.gateway.routing.peers import Peers, ReplicaRefused, SchedulerReplica
from pagoda.services.gateway.routing.router import RouteRequest

logger = logging.getLogger(__name__)
MAX_ATTEMPTS = 3
# With no replica routable (a rollout: the old ones left, the new ones are being
# probed), how long a request waits for one before its 503.
ROUTE_WAIT_S = 3.0


def route_request(requests: Sequence[EngineCoreRequest], session_key: str | None,
                  block_hashes: Sequence[bytes] | None = None) -> RouteRequest:
    """`block_hashes`: the first prompt's, if its tokenization returned them."""
    first = requests[0]
    context = router_context.current()
    if context is not None and context.session_key:
        session_key = context.session_key  # the header wins over the body's `user`
    return RouteRequest(first.prompt_token_ids, sum(len(r.prompt_token_ids) for r in requests),
                        len(requests), first.cache_salt or "", session_key, block_hashes,
                        first.lora_request)


async def routed_deltas(peers: Peers, requests: Sequence[EngineCoreRequest],
                        open_streams: Callable[[SchedulerReplica], AsyncIterator],
                        session_key: str | None = None,
                        block_hashes: Sequence[bytes] | None = None) -> AsyncIterator:
    """The deltas of `open_streams(replica)` for the replica the router picks."""
    request = route_request(requests, session_key, block_hashes)
    context = router_context.current()
    metrics = gateway_metrics()
    excluded: set[str] = set()
    refusal: ReplicaRefused | None = None
    for _ in range(MAX_ATTEMPTS):
        try:
            route = await peers.router.route(peers.schedulers, request, peers.tokenizer.stub,
                                             frozenset(excluded))
        except APIError:
            if refusal is not None:
                raise refusal from None  # the replicas' own reason beats "none available"
            if not excluded and await peers.wait_routable(ROUTE_WAIT_S):
                continue  # one became routable meanwhile: route again
            raise
        replica = route.replica
        if context is not None:
            context.instance_id = replica.instance_id
        metrics.routing_decisions.labels(route.policy, replica.instance_id).inc()
        produced, actual = False, None
        # --kv-prefix-pull: the replica, with a lease on another one's cached prefix.
        pulling = peers.prefix_pull.wrap(route, request) if peers.prefix_pull else replica
        stream = open_streams(pulling)
        try:
            async for delta in stream:
                if not produced:
                    produced = True
                    route.prefill_done()
                if delta.index == 0:
                    actual = delta.num_cached_tokens
                yield delta
            return
        except ReplicaRefused as exc:
            if produced:
                raise
            refusal = exc
            excluded.add(replica.address)
            replica.on_refused(exc)
            logger.info("replica %s refused a request (%s); trying another", replica.address,
                        exc.message)
        finally:
            await stream.aclose()
            route.release()
            if route.predicted_cached_tokens is not None and actual is not None:
                metrics.cached_tokens.labels("predicted").inc(route.predicted_cached_tokens)
                metrics.cached_tokens.labels("actual").inc(actual)
    raise refusal
