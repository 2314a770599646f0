"""Request migration: a choice whose replica goes away continues on another one.

    replica A: prompt ──► t1 t2 t3 ✗ (died, stopped answering, drained out of time)
    replica B: prompt + [t1 t2 t3] as output_token_ids, same params ──► t4 ... tN

The scheduler treats `output_token_ids` as tokens it generated itself: max_tokens,
min_tokens, penalties and stop token ids count them, and the gpu-worker advances a
seeded request's generator past them, so a greedy or seeded choice continues
exactly as it would have on A (choices.py keeps the decoder, so stop strings and
the text so far carry over; usage counts each token once, as it reaches the client).

`Migration` is shared by the choices of one HTTP request: the replicas that failed
it are excluded for all of them, and `started` tells a choice refused at its first
attempt whether the request already streamed (then it re-routes alone; before that
routing/dispatch.py retries the whole request). Each choice may migrate at most
`--migration-limit` times (default 3); past that, or with no replica left, it fails
with the error that ended its last replica. Migrations are counted by reason in
`pagoda_gateway_migrations_total`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from pagoda.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from pagoda.services.gateway.errors import APIError
from pagoda.services.gateway.observability.metrics import gateway_metrics
from pagoda.services.gateway.routing.peers import (Peers, ReplicaLost, ReplicaRefused,
                                                   SchedulerReplica)
from pagoda.services.gateway.routing.router import Route, RouteRequest

logger = logging.getLogger(__name__)
DEFAULT_MIGRATION_LIMIT = 3
# Refusals in a row (a draining or full replica) a re-routed choice accepts.
MAX_REFUSALS = 3


class Migration:
    """Invariant: `excluded` only grows (a replica that failed this request is never
    tried again for it), and every `Route` returned by `reroute` is released by the
    choice that asked for it."""

    def __init__(self, peers: Peers, limit: int = DEFAULT_MIGRATION_LIMIT,
                 session_key: str | None = None, cache_salt: str | None = None) -> None:
        self.peers = peers
        self.limit = limit
        self.session_key = session_key
        self.cache_salt = cache_salt
        self.excluded: set[str] = set()
        self.started = False  # some choice has produced a delta

    async def reroute(self, choice: "ChoiceRoute", failed: SchedulerReplica,
                      error: ReplicaLost | ReplicaRefused) -> Route:
        """The next replica for `choice`, whose replica `failed` with `error`; raises
        `error` (an APIError) when the limit is reached or no replica is left."""
        self.excluded.add(failed.address)
        failed.on_refused(error)
        if isinstance(error, ReplicaLost):
            choice.last_loss = error
            choice.num_migrations += 1
            choice.num_refusals = 0
            if choice.num_migrations > self.limit:
                raise APIError(f"{error.message} The request was moved to another replica "
                               f"{self.limit} times already (--migration-limit).", 503) from None
        else:
            choice.num_refusals += 1
            if choice.num_refusals > MAX_REFUSALS:
                raise error
        request = choice.request
        tokens = [*request.prompt_token_ids, *choice.generated]
        try:
            route = await self.peers.router.route(
                self.peers.schedulers,
                RouteRequest(tokens, len(tokens), 1, self.cache_salt or "", self.session_key,
                             lora_request=request.lora_request),
                self.peers.tokenizer.stub, frozenset(self.excluded))
        except APIError:
            # What ended the choice's stream says more than "no replica is available".
            raise (choice.last_loss or error) from None
        metrics = gateway_metrics()
        metrics.routing_decisions.labels(route.policy, route.replica.instance_id).inc()
        if isinstance(error, ReplicaLost):
            metrics.migrations.labels(error.reason).inc()
            logger.info("request %s: %s on %s after %d tokens; continuing on %s",
                        request.request_id, error.reason, failed.address, len(choice.generated),
                        route.replica.address)
        return route


class ChoiceRoute:
    """One choice's place in its migrations: the tokens generated so far (on every
    replica it ran on, each once) and how often it moved."""

    def __init__(self, request: EngineCoreRequest) -> None:
        self.request = request
        self.generated: list[int] = []
        self.num_migrations = 0
        self.num_refusals = 0
        self.num_attempts = 0
        self.last_loss: ReplicaLost | None = None

    def next_request(self) -> EngineCoreRequest:
        """The request to send now: the original first, then the resumed form (a new
        scheduler id, so a replica that still holds the old one never sees a clash)."""
        self.num_attempts += 1
        if self.num_attempts == 1:
            return self.request
        # Everything else as sent (sampling, salt, priority, adapter); no transfer
        # params: the new replica computes or pulls the prefix afresh.
        return dataclasses.replace(
            self.request, request_id=f"{self.request.request_id}.m{self.num_attempts - 1}",
            output_token_ids=list(self.generated), kv_transfer_params=None)

    def finish_without_replica(self) -> EngineCoreOutput | None:
        """The output that ends the choice when its tokens already end it (the replica
        went away between its last token and its `complete`), else None. The rule is
        the scheduler's (`Request.check_stop`), so the end is the one it would have sent."""
        params = self.request.sampling_params
        generated = self.generated
        if not generated or len(generated) < params.min_tokens:
            return None
        last, rid = generated[-1], self.request.request_id
        if not params.ignore_eos and last in self.request.eos_token_ids:
            return EngineCoreOutput(rid, [], finish_reason=FinishReason.STOP)
        if last in (params.stop_token_ids or ()):
            return EngineCoreOutput(rid, [], finish_reason=FinishReason.STOP, stop_reason=last)
        if params.max_tokens is not None and len(generated) >= params.max_tokens:
            return EngineCoreOutput(rid, [], finish_reason=FinishReason.LENGTH)
        return None


def enders(request: EngineCoreRequest) -> Sequence[int]:
    """Token ids that end the request when sampled (the sampler masks them before
    min_tokens): stop token ids, and EOS unless ignore_eos."""
    params = request.sampling_params
    ids = set(params.stop_token_ids or ())
    if not params.ignore_eos:
        ids.update(request.eos_token_ids)
    return ids
