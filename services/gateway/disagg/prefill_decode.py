"""Prefill/decode disaggregation at the gateway: one choice, two replicas, one stream.

    choice ─► prefill replica (kv_producer): prompt, max_tokens 1, do_remote_decode
              (its images with their pixels: it encodes them)
           ◄─ first token (streamed to the client at once) + complete{kv_transfer_params}
           ─► decode replica: prompt + [first token] as output, do_remote_prefill
              (it pulls the blocks it lacks worker to worker, then decodes; its images
              come without pixels where the lease covers their runs: disagg/media.py)
           ◄─ the remaining tokens

`DisaggregatedReplica` wraps the decode replica the router chose and looks like it to
generation/choices.py, so migration, stop strings, logprobs and usage work unchanged. Whatever
goes wrong on the prefill side before the first token (no prefill replica, it
refused, it died) the decode replica prefills locally: the client sees no error and
the fallback is counted. The lease is always released by the gateway when the choice
ends (the decode replica releases it first after its pull; releasing twice is
harmless), so a dead decode replica strands nothing; a client that leaves after the
first token, before the prefill's end named the lease, has the rest of the prefill
stream read in the background and that lease released (`release_when_done`); the
prefill side's reaper covers a dead gateway.

The handshake: a prefill replica serves only decode replicas whose model and KV
layout (dtype, block size, the model's layers and KV heads, head size, layout, hash
seed) and connector equal its own (tensor- and pipeline-parallel shapes may differ:
blocks travel whole, pagoda.kv_transfer.block_shares). The gateway checks every pair
on each health poll (`readiness_problem`, one of Peers.readiness_checks), not at the
first request: in a P/D cluster (a replica says kv_producer or kv_consumer) `/health`
is 200 only once a routable decode replica has a prefill replica it pairs with, so the
first request after readiness is split. A mismatch is logged as an error once per pair
of incarnations, naming the fields and both sides' values, counted in
pagoda_gateway_disagg_handshake_mismatches_total{field}; before the gateway was ever
ready it is also said by `/health` and fatal (the gateway exits naming it, and so does
`pagoda serve`). A mismatch later (a replica restarted differently), or a prefill pool
that is gone, keeps the pair apart: each request is prefilled by its decode replica and
counted as a no_prefill_replica fallback, logged and counted, while `/health` stays 200
(an unready gateway behind a readiness probe would turn a misconfigured or lost prefill
pool into an outage of every request).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc

import pagoda.tracing as tracing
from pagoda.core.media_guard import MISSING_ENCODER_INPUT
from pagoda.kv_transfer.config import DIST_CONNECTOR
from pagoda.kv_transfer.params import KVTransferParams
from pagoda.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2 as kpb
from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2_grpc as kpb_grpc
from pagoda.services.gateway.disagg.labels import HANDSHAKE_FIELDS
from pagoda.services.gateway.disagg.media import decode_side_features
from pagoda.services.gateway.errors import APIError
from pagoda.services.gateway.observability.metrics import gateway_metrics
from pagoda.services.gateway.routing import context as router_context
from pagoda.services.gateway.routing.peers import (Peers, ReplicaLost, ReplicaRefused,
                                                   SchedulerReplica)
from pagoda.services.gateway.routing.router import RouteRequest

logger = logging.getLogger(__name__)
# How long a prefill whose client left may take to end and name its lease.
PREFILL_DRAIN_S = 30.0


PD_ROLES = ("kv_producer", "kv_consumer")  # a replica with one: the cluster is P/D


def handshake_mismatches(prefill, decode) -> list[tuple[str, str]]:
    """(field, "prefill value vs decode value") for each field on which the two
    replicas (GetModelInfoResponse) disagree; empty when they can exchange blocks."""
    found = []
    if prefill.model != decode.model:
        found.append(("model", f"{prefill.model!r} vs {decode.model!r}"))
    if prefill.kv_connector != decode.kv_connector:  # each side's transport
        found.append(("kv_connector", f"{prefill.kv_connector!r} vs {decode.kv_connector!r}"))
    elif prefill.kv_connector == DIST_CONNECTOR and \
            prefill.kv_layout.device_type != decode.kv_layout.device_type:  # NCCL vs gloo
        found.append(("device_type", f"{prefill.kv_layout.device_type!r} vs "
                                      f"{decode.kv_layout.device_type!r}"))
    for name in HANDSHAKE_FIELDS:
        a, b = getattr(prefill.kv_layout, name), getattr(decode.kv_layout, name)
        if a != b:
            found.append((name, f"{a!r} vs {b!r}"))
    return found


def handshake_problem(prefill, decode) -> str | None:
    """None when the two replicas (GetModelInfoResponse) can exchange blocks, else a
    message naming the fields and both sides' values."""
    found = handshake_mismatches(prefill, decode)
    if not found:
        return None
    return (f"prefill {prefill.instance_id} and decode {decode.instance_id} cannot exchange "
            f"KV blocks (prefill vs decode): {', '.join(f'{n} {v}' for n, v in found)}")


class PrefillView:
    """A kv_producer replica as the router sees it for a prefill: routable while it
    serves and agrees with the decode replica (`handshake_problem`). Load counts go
    to the replica itself."""

    _OWN = ("replica", "decode", "disagg")

    def __init__(self, replica: SchedulerReplica, decode: SchedulerReplica,
                 disagg: "Disaggregation") -> None:
        object.__setattr__(self, "replica", replica)
        object.__setattr__(self, "decode", decode)
        object.__setattr__(self, "disagg", disagg)

    def __getattr__(self, name):
        return getattr(self.replica, name)

    def __setattr__(self, name, value) -> None:
        setattr(self.replica, name, value)

    def is_routable(self) -> bool:
        r = self.replica
        if not (r.serving and r.info is not None and r.hashes_agree is True and not r.removed):
            return False
        return self.disagg.pair_problem(r, self.decode) is None


class Disaggregation:
    """The gateway's view of its prefill replicas (shared by every request)."""

    def __init__(self, peers: Peers) -> None:
        self.peers = peers
        # (prefill epoch, decode epoch) -> the pair's handshake problem (None: they pair).
        self.checks: dict[tuple[str, str], str | None] = {}
        self._lease_stubs: dict[str, kpb_grpc.KvLeaseServiceStub] = {}
        self._draining: set[asyncio.Task] = set()  # release_when_done's, held till done
        peers.readiness_checks.append(self.readiness_problem)

    def pair_problem(self, prefill: SchedulerReplica, decode: SchedulerReplica) -> str | None:
        """The handshake of these two incarnations, checked once: a mismatch is logged,
        counted by field, and fatal if the gateway was never ready yet."""
        key = (prefill.info.epoch, decode.info.epoch)
        if key not in self.checks:
            found = handshake_mismatches(prefill.info, decode.info)
            problem = handshake_problem(prefill.info, decode.info) if found else None
            self.checks[key] = problem
            if problem is not None:
                logger.error("%s; no request goes that way", problem)
                for field, _ in found:
                    gateway_metrics().disagg_handshake_mismatches.labels(field).inc()
                self.peers.fail_start(problem)
        return self.checks[key]

    def readiness_problem(self) -> str | None:
        """Why the gateway is not ready for P/D, or None: in a colocated cluster (no
        replica in a P/D role), or once some routable decode replica pairs with a
        serving prefill replica. Checks every such pair, so a mismatch shows at once."""
        known = [s for s in self.peers.schedulers if s.info is not None and not s.removed]
        if not any(s.info.kv_role in PD_ROLES for s in known):
            return None
        decodes = [s for s in known if s.is_routable()]
        prefills = [PrefillView(p, d, self) for d in decodes
                    for p in self.prefill_replicas() if not p.removed]
        if any(view.is_routable() for view in prefills):
            return None
        for view in prefills:
            problem = self.checks.get((view.replica.info.epoch, view.decode.info.epoch))
            if problem is not None:
                return f"no prefill/decode pair can exchange KV blocks: {problem}"
        return ("prefill/decode disaggregation: no prefill (kv_producer) replica serves and "
                "passed its checks yet")

    def prefill_replicas(self) -> list[SchedulerReplica]:
        return [s for s in self.peers.schedulers
                if s.info is not None and s.info.kv_role == "kv_producer"]

    def is_enabled(self) -> bool:
        return bool(self.prefill_replicas())

    def wrap(self, decode: SchedulerReplica) -> SchedulerReplica:
        return DisaggregatedReplica(self, decode) if self.is_enabled() else decode

    def release_soon(self, params: KVTransferParams) -> None:
        """Release a lease without waiting (idempotent at the prefill replica)."""
        address = params.remote_scheduler_address
        stub = self._lease_stubs.get(address)
        if stub is None:
            replica = next((s for s in self.peers.schedulers if s.address == address), None)
            if replica is None:
                return  # gone from discovery: its reaper frees the blocks
            stub = kpb_grpc.KvLeaseServiceStub(replica.channel)
            self._lease_stubs[address] = stub

        async def release() -> None:
            try:
                await stub.ReleaseLease(kpb.ReleaseLeaseRequest(
                    lease_id=params.lease_id, epoch=params.remote_epoch), timeout=5.0)
            except grpc.RpcError:
                pass  # the prefill replica is gone or busy: its reaper frees the blocks

        asyncio.get_running_loop().create_task(release())

    def release_when_done(self, stream: AsyncIterator[EngineCoreOutput]) -> None:
        """The prefill `stream` of a choice whose client left: read it to its end (the
        lease comes with it) and release that lease, without waiting; a stream that
        has not ended within PREFILL_DRAIN_S is closed (the prefill replica aborts it,
        or its reaper frees what it leased)."""

        async def drain() -> None:
            async for out in stream:
                if out.finished:
                    if out.kv_transfer_params is not None:
                        self.release_soon(out.kv_transfer_params)
                    return

        async def drain_then_close() -> None:
            try:
                await asyncio.wait_for(drain(), PREFILL_DRAIN_S)
            except (asyncio.TimeoutError, ReplicaRefused, ReplicaLost, grpc.RpcError):
                pass  # nothing to release, or the prefill replica's reaper will
            finally:
                await stream.aclose()

        self._draining.add(task := asyncio.get_running_loop().create_task(drain_then_close()))
        task.add_done_callback(self._draining.discard)


def disaggregation_of(peers: Peers) -> Disaggregation:
    """The gateway's one Disaggregation, kept on its Peers."""
    disagg = getattr(peers, "_disaggregation", None)
    if disagg is None:
        disagg = peers._disaggregation = Disaggregation(peers)
    return disagg


def _count_fallback(kind: str) -> None:
    gateway_metrics().disagg_fallbacks.labels(kind).inc()


class DisaggregatedReplica:
    """The decode replica of a choice, with the prefill done elsewhere first."""

    def __init__(self, disagg: Disaggregation, decode: SchedulerReplica) -> None:
        self.disagg = disagg
        self.decode = decode

    def __getattr__(self, name):
        return getattr(self.decode, name)

    async def generate(self, request: EngineCoreRequest) -> AsyncIterator[EngineCoreOutput]:
        if request.output_token_ids or request.pooling_params is not None:
            async for out in self.decode.generate(request):  # a resumed choice: decode only
                yield out
            return
        disagg = self.disagg
        prefill_span = _phase_span("pagoda.disagg.prefill", request.request_id)
        views = [PrefillView(r, self.decode, disagg) for r in disagg.prefill_replicas()]
        try:
            route = await disagg.peers.router.route(
                views, RouteRequest(request.prompt_token_ids, len(request.prompt_token_ids), 1,
                                    request.cache_salt or "",
                                    lora_request=request.lora_request),
                disagg.peers.tokenizer.stub)
        except APIError:
            _count_fallback("no_prefill_replica")
            _end_span(prefill_span, fallback="no_prefill_replica")
            async for out in self.decode.generate(request):
                yield out
            return
        context = router_context.current()
        if context is not None:
            context.prefill_instance_id = route.replica.instance_id
        gateway_metrics().routing_decisions.labels(f"prefill:{route.policy}",
                                                   route.replica.instance_id).inc()
        generated: list[int] = []
        end: EngineCoreOutput | None = None
        prefill = replace(
            request, request_id=f"{request.request_id}.prefill",
            sampling_params=replace(request.sampling_params, max_tokens=1,
                                    min_tokens=min(request.sampling_params.min_tokens, 1)),
            kv_transfer_params=KVTransferParams(do_remote_decode=True))
        stream = route.replica.generate(prefill)
        try:
            async for out in stream:
                if out.finished:
                    end = out
                    break
                generated.extend(out.new_token_ids)
                if out.new_token_ids:
                    route.prefill_done()
                yield out
        except GeneratorExit:  # the client left after a token: its lease is still to come
            disagg.release_when_done(stream)
            raise
        except (ReplicaRefused, ReplicaLost) as exc:
            logger.warning("prefill replica %s failed (%s); the decode replica computes the "
                           "prompt", route.replica.address, exc.message)
            route.replica.on_refused(exc)
            _count_fallback("prefill_failed")
            _end_span(prefill_span, fallback="prefill_failed")
        finally:
            route.release()
            _end_span(prefill_span, instance=route.replica.instance_id)
        params = end.kv_transfer_params if end is not None else None
        decode_span = None
        try:
            if end is not None and _ends_request(request, end, generated):
                yield end
                return
            decode = replace(request, output_token_ids=list(generated), kv_transfer_params=None)
            if generated and params is not None:
                decode.kv_transfer_params = replace(params, do_remote_prefill=True)
                # The prefill side encoded the images: no pixels where the lease covers them.
                decode.mm_features = decode_side_features(
                    request.mm_features, params, self.decode.info.block_size)
                if request.sampling_params.prompt_logprobs is not None:  # scored already
                    decode.sampling_params = replace(request.sampling_params,
                                                     prompt_logprobs=None)
            cached = params.num_cached_tokens if params is not None else None
            decode_span = _phase_span("pagoda.disagg.decode", request.request_id,
                                      blocks=len(params.remote_block_ids) if params else 0)
            received = False
            try:
                async for out in self.decode.generate(decode):
                    received = True
                    if cached is not None:
                        out.num_cached_tokens = cached
                    yield out
            except grpc.RpcError as exc:
                if received or all(f.data is not None for f in decode.mm_features) \
                        or not refused_for_missing_media(exc):
                    raise
                # Its import fell short of an image's run (a failed pull): compute the
                # prompt there as a colocated replica would, with the pixels.
                logger.warning("decode replica %s lacked an image's KV (%s); sending the "
                               "request again with its pixels", self.decode.address,
                               exc.details())
                _count_fallback("media_recompute")
                again = replace(decode, mm_features=request.mm_features,
                                kv_transfer_params=None)
                async for out in self.decode.generate(again):
                    yield out
        finally:
            _end_span(decode_span, instance=self.decode.instance_id)
            if params is not None:
                disagg.release_soon(params)


def refused_for_missing_media(exc: grpc.RpcError) -> bool:
    """Whether a decode replica refused a request for an image it got without pixels
    and would have had to encode (`pagoda.core.media_guard`)."""
    return exc.code() == grpc.StatusCode.INVALID_ARGUMENT and \
        MISSING_ENCODER_INPUT in (exc.details() or "")


def _phase_span(name: str, request_id: str, **attributes):
    """A span for one phase of a disaggregated request, a child of the HTTP request's
    span (the gRPC calls of the phase are its siblings: an async generator cannot
    hold a current context across its yields); None while tracing is off."""
    if not tracing.is_enabled():
        return None
    return tracing.get_tracer().start_span(name, attributes={
        "pagoda.request_id": request_id,
        **{f"pagoda.{key}": value for key, value in attributes.items()}})


def _end_span(span, **attributes) -> None:
    """End `span` once (later calls only add nothing)."""
    if span is None or not span.is_recording():
        return
    for key, value in attributes.items():
        span.set_attribute(f"pagoda.{key}", value)
    span.end()


def _ends_request(request: EngineCoreRequest, end: EngineCoreOutput,
                  generated: list[int]) -> bool:
    """Whether the prefill's end is the request's (EOS, a stop token, its max_tokens,
    an abort) rather than the max_tokens of 1 the prefill was given."""
    if end.finish_reason != FinishReason.LENGTH or not generated:
        return True
    max_tokens = request.sampling_params.max_tokens
    return max_tokens is not None and len(generated) >= max_tokens
