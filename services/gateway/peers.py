"""The gateway's gRPC peers: the tokenizer and the scheduler replicas.

The gateway starts before its peers may be up (as in Kubernetes): a background
task keeps polling their health and model info, and `/health` answers 503 until
the tokenizer and at least one scheduler serve.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagoda._proto.pagoda.scheduler.v1 import scheduler_pb2 as spb
from pagoda._proto.pagoda.scheduler.v1 import scheduler_pb2_grpc as spb_grpc
from pagoda._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as tpb
from pagoda._proto.pagoda.tokenizer.v1 import tokenizer_pb2_grpc as tpb_grpc
from pagoda.engine.core_types import EngineCoreOutput, EngineCoreRequest
from pagoda.protocol.scheduler import request_to_proto, response_to_output
from pagoda.services.common.grpc_server import CLIENT_OPTIONS, STREAM_READER_OPTIONS
from pagoda.services.gateway.decode_mux import DecodeMux
from pagoda.services.gateway.errors import APIError

logger = logging.getLogger(__name__)
SERVING = health_pb2.HealthCheckResponse.SERVING
HEALTH_POLL_S = 2.0


class Peer:
    """One gRPC peer: its channel, health stub and last known state."""

    def __init__(self, name: str, address: str, options=CLIENT_OPTIONS) -> None:
        self.name = name
        self.address = address
        self.channel = grpc.aio.insecure_channel(address, options=options)
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


class SchedulerReplica(Peer):
    def __init__(self, address: str) -> None:
        super().__init__("scheduler", address, STREAM_READER_OPTIONS)
        self.stub = spb_grpc.SchedulerServiceStub(self.channel)
        self.info: spb.GetModelInfoResponse | None = None

    async def refresh(self) -> None:
        if await self.check_health() and self.info is None:
            self.info = await self.stub.GetModelInfo(spb.GetModelInfoRequest(), timeout=5.0)

    async def generate(self, request: EngineCoreRequest) -> AsyncIterator[EngineCoreOutput]:
        """The request's outputs; closing the iterator early cancels the call, which
        aborts the request in the scheduler."""
        call = self.stub.Generate(request_to_proto(request))
        try:
            async for message in call:
                yield response_to_output(request.request_id, message)
        finally:
            call.cancel()


class TokenizerPeer(Peer):
    def __init__(self, address: str) -> None:
        super().__init__("tokenizer", address)
        self.stub = tpb_grpc.TokenizerServiceStub(self.channel)
        self.info: tpb.GetTokenizerInfoResponse | None = None
        self.mux = DecodeMux(self.stub)

    async def refresh(self) -> None:
        if await self.check_health() and self.info is None:
            self.info = await self.stub.GetTokenizerInfo(tpb.GetTokenizerInfoRequest(),
                                                         timeout=5.0)


class Peers:
    """All peers of one gateway, with round-robin routing over serving schedulers."""

    def __init__(self, tokenizer_addr: str, scheduler_addrs: list[str]) -> None:
        if not scheduler_addrs:
            raise ValueError("at least one scheduler address is required")
        self.tokenizer = TokenizerPeer(tokenizer_addr)
        self.schedulers = [SchedulerReplica(a) for a in scheduler_addrs]
        self._round_robin = itertools.cycle(range(len(self.schedulers)))
        self._task: asyncio.Task | None = None
        self.ready = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._poll())

    async def refresh(self) -> None:
        await asyncio.gather(self.tokenizer.refresh(), *(s.refresh() for s in self.schedulers),
                             return_exceptions=True)
        if self.is_healthy():
            self.ready.set()

    def is_healthy(self) -> bool:
        return (self.tokenizer.serving and self.tokenizer.info is not None
                and any(s.serving and s.info is not None for s in self.schedulers))

    def pick_scheduler(self) -> SchedulerReplica:
        """Round robin over the replicas that serve (the KV-aware router comes later)."""
        for _ in range(len(self.schedulers)):
            replica = self.schedulers[next(self._round_robin)]
            if replica.serving and replica.info is not None:
                return replica
        raise APIError("No scheduler replica is available.", 503)

    def model_info(self) -> spb.GetModelInfoResponse:
        for replica in self.schedulers:
            if replica.info is not None:
                return replica.info
        raise APIError("The model is not loaded yet.", 503)

    def tokenizer_info(self) -> tpb.GetTokenizerInfoResponse:
        if self.tokenizer.info is None:
            raise APIError("The tokenizer is not available yet.", 503)
        return self.tokenizer.info

    async def _poll(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # keep polling whatever a peer does
                logger.exception("peer refresh failed")
            await asyncio.sleep(HEALTH_POLL_S if self.ready.is_set() else 0.2)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self.tokenizer.mux.close()
        for peer in [self.tokenizer, *self.schedulers]:
            await peer.channel.close()
