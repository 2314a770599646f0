"""The gateway's gRPC peers: the tokenizer and the scheduler replicas.

The gateway starts before its peers may be up (as in Kubernetes): a background
task keeps polling their health, model info and load, and `/health` answers 503
(saying why: `not_ready_reason`) until the tokenizer and at least one routable
scheduler serve and every `readiness_checks` hook agrees (the P/D pairing check,
disagg/prefill_decode.py); the hooks hold back only the first readiness. Replicas come
from `--scheduler-addrs` (discovery.py: fixed addresses, or DNS names
re-resolved every few seconds); one that joins is routable after its first
successful poll (<= HEALTH_POLL_S), one that leaves DNS or stops serving gets no
new request, and its channel closes once its last request has ended. With
`k8s://` discovery a change in the Service's endpoints wakes the poll at once.

When routing uses the prefix index, each replica must first prove that its block
hashes equal the tokenizer's (block_hash_check.py); a mismatch before the gateway
was ever ready is fatal (`on_fatal`), later it only keeps that replica out.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2 as spb
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2_grpc as spb_grpc
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as tpb
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2_grpc as tpb_grpc
from opentelemetry import trace

import pagoda.tracing as tracing
from pagoda.messages import EngineCoreOutput, EngineCoreRequest
from pagoda.services.common.protocol.scheduler import (MIGRATION_REASON_KEY, request_to_proto,
                                                       response_to_output)
from pagoda.services.common import grpc_channels
from pagoda.services.common.grpc_channels import CLIENT_OPTIONS, STREAM_READER_OPTIONS
from pagoda.services.gateway.errors import APIError, from_grpc_error
from pagoda.services.gateway.generation import local_decode
from pagoda.services.gateway.generation.decode_mux import DecodeMux
from pagoda.services.gateway.generation.local_decode import LocalDecodeMux
from pagoda.services.gateway.routing.block_hash_check import check_block_hashes
from pagoda.services.gateway.routing.generate_mux import (GenerateMux, StreamUnsupported,
                                                          generate_stream_enabled)
from pagoda.services.gateway.routing.discovery import Discovery, parse_scheduler_addrs
from pagoda.services.gateway.routing.prefix_index import PrefixIndexClient
from pagoda.services.gateway.routing.router import DEFAULT_POLICY, Router
from pagoda.services.gateway.routing.tokenizer_channel import (tokenizer_channel_options,
                                                               tokenizer_target)

logger = logging.getLogger(__name__)
SERVING = health_pb2.HealthCheckResponse.SERVING
HEALTH_POLL_S = 1.0
# Failures before any output that another replica may retry (dispatch.py).
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
# Failures after output that end the replica's part, not the request: it died, stopped
# answering (keepalive, bounded reads) or drained out of time; the request migrates
# (generation/migration.py). CANCELLED here is the server's doing: the gateway reads no call it
# cancelled itself.
MIGRATABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED)


class Peer:
    """One gRPC peer: its channel, health stub and last known state."""

    def __init__(self, name: str, address: str, options=CLIENT_OPTIONS) -> None:
        self.name = name
        self.address = address
        self.channel = grpc_channels.aio_channel(address, options)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self.serving = False

    async def check_health(self) -> bool:
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(), timeout=2.0)
            serving = reply.status == SERVING
        except grpc.RpcError:
            serving = False
        if serving != self.serving:
            logger.info("%s at %s is %s", self.name, self.address,
                        "serving" if serving else "not serving")
        self.serving = serving
        return serving


class ReplicaRefused(APIError):
    """A replica failed a request before producing any output (retryable elsewhere)."""

    def __init__(self, exc: grpc.RpcError, address: str) -> None:
        error = from_grpc_error(exc, "scheduler")
        super().__init__(error.message, error.status, error.param, error.err_type, error.headers)
        self.code = exc.code()


class ReplicaLost(APIError):
    """A replica stopped serving a request that had produced output; `reason` (the
    migrations metric's label) is the scheduler's own word for it when it said one
    (drain_timeout, replica_failed), else replica_lost (the connection, or silence)."""

    def __init__(self, message: str, address: str, reason: str = "replica_lost") -> None:
        super().__init__(message, 503)
        self.address = address
        self.reason = reason

    @classmethod
    def from_rpc_error(cls, exc: grpc.RpcError, address: str) -> "ReplicaLost":
        reason = "replica_lost"
        metadata = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
        for key, value in metadata or ():
            # A word outside the known ones counts as replica_lost: the label's values
            # stay the ones exported at 0 from start-up (metrics.MIGRATION_REASONS).
            if key == MIGRATION_REASON_KEY and value in _LOST_MESSAGES:
                reason = value
        logger.warning("scheduler %s lost a request (%s: %s)", address, exc.code().name,
                       exc.details())
        return cls(_LOST_MESSAGES[reason], address, reason)


_LOST_MESSAGES = {
    "replica_lost": "The model replica serving this request stopped answering.",
    "replica_failed": "The model replica serving this request failed.",
    "drain_timeout": "The model replica serving this request shut down before it finished.",
}


class SchedulerReplica(Peer):
    """One model replica, with the load this gateway put on it (router.Route keeps
    `num_in_flight` and `num_pending_tokens`) and the load it last reported."""

    def __init__(self, address: str) -> None:
        super().__init__("scheduler", address, STREAM_READER_OPTIONS)
        self.stub = spb_grpc.SchedulerServiceStub(self.channel)
        self.info: spb.GetModelInfoResponse | None = None
        self.load: spb.GetLoadResponse | None = None
        self.hashes_agree: bool | None = None  # None: not checked yet
        self.removed = False  # left discovery: no new requests, close when idle
        self.num_in_flight = 0
        self.num_pending_tokens = 0
        self.mux = GenerateMux(self.stub, address)
        self.mux_enabled = generate_stream_enabled()

    @property
    def instance_id(self) -> str:
        return self.info.instance_id if self.info is not None and self.info.instance_id \
            else self.address

    def is_routable(self) -> bool:
        """Routable for a whole request (a kv_producer replica only prefills:
        disagg/prefill_decode.py)."""
        return (self.serving and self.info is not None and self.hashes_agree is True
                and not self.removed and self.info.kv_role != "kv_producer")

    def num_requests(self) -> int:
        """Requests on the replica: ours in flight, or all it reported if more."""
        reported = self.load.num_running + self.load.num_waiting if self.load else 0
        return max(self.num_in_flight, reported)

    def on_refused(self, error: ReplicaRefused | ReplicaLost) -> None:
        if isinstance(error, ReplicaLost) or error.code == grpc.StatusCode.UNAVAILABLE:
            self.serving = False  # until the next poll finds it serving again

    async def refresh(self) -> None:
        was_serving = self.serving
        if not await self.check_health():
            self.load = None
            return
        if self.info is None or not was_serving:  # new, or back (maybe restarted)
            self.info = await self.stub.GetModelInfo(spb.GetModelInfoRequest(), timeout=5.0)
            self.hashes_agree = None
            self.mux.reset()
        try:
            self.load = await self.stub.GetLoad(spb.GetLoadRequest(), timeout=2.0)
        except grpc.RpcError:
            self.load = None  # load-aware routing then counts only our own requests
            return
        if self.load.epoch and self.load.epoch != self.info.epoch:
            # Restarted between two polls (never seen down): a new incarnation, whose
            # handshake and hash check must run again.
            self.info = await self.stub.GetModelInfo(spb.GetModelInfoRequest(), timeout=5.0)
            self.hashes_agree = None
            self.mux.reset()

    async def generate(self, request: EngineCoreRequest) -> AsyncIterator[EngineCoreOutput]:
        """The request's outputs; closing the iterator early aborts the request in the
        scheduler. Raises ReplicaRefused for a retryable failure before the first
        output, ReplicaLost for a migratable one after it. Over the replica's one
        `GenerateStream` (generate_mux.py) unless it lacks it or the request is traced:
        then a `Generate` call."""
        stream = (self._call_outputs(request) if not self.mux_enabled
                  or self.mux.supported is False or _traced() else self.mux.outputs(request))
        received = False
        try:
            while True:
                try:
                    out = await stream.__anext__()
                except StopAsyncIteration:
                    return
                except StreamUnsupported:  # an older replica: before any output
                    await stream.aclose()
                    stream = self._call_outputs(request)
                    continue
                received = True
                yield out
        except grpc.RpcError as exc:
            if not received and exc.code() in RETRYABLE:
                raise ReplicaRefused(exc, self.address) from None
            if received and exc.code() in MIGRATABLE:
                raise ReplicaLost.from_rpc_error(exc, self.address) from None
            raise
        finally:
            await stream.aclose()

    async def _call_outputs(self, request: EngineCoreRequest) -> AsyncIterator[EngineCoreOutput]:
        """The outputs of one `Generate` call (cancelled when the iterator closes)."""
        call = self.stub.Generate(request_to_proto(request))
        try:
            while (message := await grpc_channels.read_within(
                    call, grpc_channels.GENERATE_READ_TIMEOUT_S, "the scheduler")
                   ) is not grpc.aio.EOF:
                yield response_to_output(request.request_id, message)
        finally:
            call.cancel()


def _traced() -> bool:
    """Whether the request being served is sampled for tracing: it then takes its own
    `Generate` call, whose span the scheduler's spans of it (queue, prefill, decode,
    its steps) hang under; the shared stream has no span per request."""
    if not tracing.is_enabled():
        return False
    return trace.get_current_span().get_span_context().trace_flags.sampled


class TokenizerPeer(Peer):
    """Every tokenizer replica behind one round-robin channel (tokenizer_channel.py):
    `serving` while any of them is."""

    def __init__(self, address: str) -> None:
        super().__init__("tokenizer", tokenizer_target(address),
                         tokenizer_channel_options(address))
        self.stub = tpb_grpc.TokenizerServiceStub(self.channel)
        self.info: tpb.GetTokenizerInfoResponse | None = None
        # Completions decode through `mux`: the service's stream, until the service's
        # tokenizer loads here (local_decode.py); a completion keeps the mux it began on.
        self.remote_mux = DecodeMux(self.stub)
        self.mux: DecodeMux | LocalDecodeMux = self.remote_mux
        self._local_load: asyncio.Task | None = None

    async def refresh(self) -> None:
        if await self.check_health() and self.info is None:
            self.info = await self.stub.GetTokenizerInfo(tpb.GetTokenizerInfoRequest(),
                                                         timeout=5.0)
            if self.info.tokenizer_path and local_decode.enabled():
                self._local_load = asyncio.ensure_future(self._load_local(self.info))
            elif self.info.tokenizer_path:
                logger.info("detokenizing on the tokenizer service (%s=0)", local_decode.ENV)

    async def _load_local(self, info: tpb.GetTokenizerInfoResponse) -> None:
        """Off the event loop (a cold tokenizer takes seconds); requests meanwhile
        decode on the service."""
        mux = await asyncio.to_thread(local_decode.load_local_mux, info)
        if mux is not None:
            self.mux = mux

    async def close(self) -> None:
        if self._local_load is not None:
            self._local_load.cancel()
        await self.mux.close()
        if self.mux is not self.remote_mux:
            await self.remote_mux.close()


class Peers:
    """All peers of one gateway and its router. Create inside the event loop."""

    def __init__(self, tokenizer_addr: str, scheduler_addrs: str | list[str],
                 router: str = DEFAULT_POLICY, on_fatal: Callable[[str], None] | None = None,
                 discovery: Discovery | None = None) -> None:
        self.tokenizer = TokenizerPeer(tokenizer_addr)
        self.discovery = discovery or Discovery(parse_scheduler_addrs(scheduler_addrs))
        self.schedulers = [SchedulerReplica(a) for a in self.discovery.static_addresses()]
        self.router = Router(router)
        self.prefix_pull = None  # prefix_pull.PrefixPull with --kv-prefix-pull
        self.on_fatal = on_fatal
        self.fatal_error: str | None = None
        self._task: asyncio.Task | None = None
        self.ready = asyncio.Event()
        # Readiness beyond "a replica serves": each returns why the gateway is not ready
        # (None: ready as far as it knows); run after every poll and on every /health.
        self.readiness_checks: list[Callable[[], str | None]] = []
        self._refreshed = asyncio.Event()  # set after every refresh (wait_routable)
        # The model as the replicas last described it: it outlives any one replica, so
        # a rollout (every old replica gone, the new ones still being probed) never
        # makes requests look as if no model had ever loaded.
        self._model_info: spb.GetModelInfoResponse | None = None

    def use_prefix_index(self, kv_cache_manager_addr: str) -> None:
        """Route with the cluster prefix index at this address (before `start`)."""
        self.router.index = PrefixIndexClient(kv_cache_manager_addr)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._poll())

    async def refresh(self) -> None:
        await self._discover()
        await asyncio.gather(self.tokenizer.refresh(), *(s.refresh() for s in self.schedulers),
                             return_exceptions=True)
        await self._check_hashes()
        if self.is_healthy():
            self.ready.set()
        self._refreshed.set()

    async def wait_routable(self, timeout: float) -> bool:
        """Whether some replica is routable, waiting up to `timeout` seconds for the
        poller to find one (a new replica being probed while the old ones left)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not any(s.is_routable() for s in self.schedulers):
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            self._refreshed.clear()
            try:
                await asyncio.wait_for(self._refreshed.wait(), remaining)
            except asyncio.TimeoutError:
                return False
        return True

    def is_healthy(self) -> bool:
        return self.not_ready_reason() is None

    def not_ready_reason(self) -> str | None:
        """Why the gateway is not ready to serve (what /health says), or None."""
        if self.fatal_error is not None:
            return self.fatal_error
        if not self.tokenizer.serving or self.tokenizer.info is None:
            return "the tokenizer is not serving yet"
        if not any(s.is_routable() for s in self.schedulers):
            return "no model replica is routable yet"
        for check in self.readiness_checks:
            problem = check()  # run after start-up too: a check logs and counts what it finds
            # Only start-up waits on them: once serving, a lost or mismatched pairing
            # falls back (counted, logged) instead of turning every gateway unready, which
            # behind a Kubernetes readiness probe would be an outage.
            if problem is not None and not self.ready.is_set():
                return problem
        return None

    def fail_start(self, message: str) -> None:
        """A mismatch among the replicas found before the gateway was ever ready is
        fatal (`on_fatal`: the gateway exits naming it); later it only keeps the
        replicas concerned out of the way."""
        if not self.ready.is_set() and self.fatal_error is None:
            self.fatal_error = message
            if self.on_fatal is not None:
                self.on_fatal(message)

    def model_info(self) -> spb.GetModelInfoResponse:
        known = [s for s in self.schedulers if s.info is not None]
        for replica in sorted(known, key=lambda s: not s.is_routable()):
            self._model_info = replica.info
            return replica.info
        if self._model_info is not None:
            return self._model_info
        raise APIError("The model is not loaded yet.", 503)

    def routing_block_size(self) -> int:
        """The block size to ask `Tokenize` for a prompt's block hashes with: the
        replicas' when routing looks them up in the prefix index, else 0 (none): no
        index, or one replica, which the router picks without asking it (router.py).
        A replica that joins between this and the route is covered: the index
        client hashes a prompt that came without hashes."""
        if self.router.index is None or not (self.router.lookup_single_replica
                                             or len(self.schedulers) > 1):
            return 0
        return self.model_info().block_size

    def tokenizer_info(self) -> tpb.GetTokenizerInfoResponse:
        if self.tokenizer.info is None:
            raise APIError("The tokenizer is not available yet.", 503)
        return self.tokenizer.info

    async def _discover(self) -> None:
        if not self.discovery.is_dynamic:
            return
        addresses = await self.discovery.addresses(time.monotonic())
        known = {s.address: s for s in self.schedulers}
        for address in addresses:
            if address not in known:
                logger.info("scheduler replica %s discovered", address)
                self.schedulers.append(SchedulerReplica(address))
            elif known[address].removed:
                known[address].removed = False
        for replica in list(self.schedulers):
            replica.removed = replica.address not in addresses
            if replica.removed and replica.num_in_flight == 0:
                logger.info("scheduler replica %s left; closing its channel", replica.address)
                self.schedulers.remove(replica)
                replica.mux.close()
                await replica.channel.close()

    async def _check_hashes(self) -> None:
        """Run the block-hash check on replicas that (re)joined."""
        pending = [s for s in self.schedulers if s.serving and s.info is not None
                   and s.hashes_agree is None]
        if not pending or self.tokenizer.info is None:
            return
        for replica in pending:
            if self.router.index is None:  # routing never looks at hashes
                replica.hashes_agree = True
                continue
            try:
                problem = await check_block_hashes(self.tokenizer.stub, replica.stub,
                                                   replica.info, self.tokenizer.info)
            except grpc.RpcError:
                continue  # a peer could not answer now: check again on the next poll
            replica.hashes_agree = problem is None
            if problem is None:
                continue
            logger.error("scheduler %s: %s; it gets no requests", replica.address, problem)
            self.fail_start(f"scheduler {replica.address}: {problem}")

    async def _poll(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # keep polling whatever a peer does
                logger.exception("peer refresh failed")
            await self.discovery.wait_changed(HEALTH_POLL_S if self.ready.is_set() else 0.2)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.discovery.close()
        await self.tokenizer.close()
        await self.router.close()
        for replica in self.schedulers:
            replica.mux.close()
        for peer in [self.tokenizer, *self.schedulers]:
            await peer.channel.close()
