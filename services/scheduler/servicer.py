"""The scheduler's RPCs (grpc.aio): one `Generate` stream per request, or many requests
over one `GenerateStream` (generate_mux.py).

Outputs arrive from the engine thread once per step (`dispatch`, scheduled onto
the event loop with one `call_soon_threadsafe` for all requests). Each stream
keeps a pending list; its handler drains whatever piled up into one message, so
a reader that falls behind gets fewer, larger chunks instead of a backlog.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2 as pb
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from pagoda.lora.request import LoRARequest
from pagoda.messages import EngineCoreOutput
from pagoda.request_checks import check_lora, check_request
from pagoda.services.common.protocol.scheduler import (MIGRATION_REASON_KEY, hash_blocks,
                                                       outputs_to_responses, request_from_proto)
from pagoda.services.scheduler.engine_loop import EngineLoop, QueueFull
from pagoda.services.scheduler.generate_mux import INVALID, MuxConnection, dispatch, error_status
from pagoda.services.scheduler import sleep_control
from pagoda.services.scheduler.lora_adapters import HeldAdapters
from pagoda.services.scheduler.metrics import count_media_input
from pagoda.services.scheduler.tracing import REQUEST_SPANS

logger = logging.getLogger(__name__)


class _RequestStream:
    """Outputs of one request not yet written to its stream; `error` (message, reason,
    whether the engine still holds the request) once the stream must end: UNAVAILABLE
    with a migration reason (the request may continue on another replica), or INTERNAL
    when the reason is None (the request itself failed)."""

    __slots__ = ("pending", "ready", "error")

    def __init__(self) -> None:
        self.pending: list[EngineCoreOutput] = []
        self.ready = asyncio.Event()
        self.error: tuple[str, str | None, bool] | None = None

    def deliver(self, output: EngineCoreOutput) -> None:
        self.pending.append(output)
        self.ready.set()

    def fail(self, error: tuple[str, str | None, bool]) -> None:
        self.error = error
        self.ready.set()


class SchedulerServicer(pb_grpc.SchedulerServiceServicer):
    """Invariant: a request is in `_streams` from its acceptance until its handler
    exits (or, on a `GenerateStream`, until its end is sent or it is aborted); one that
    leaves before it finished is aborted. Every request is checked once
    (`check_request`, the replica's trust boundary) before the engine sees it: a bad
    one is refused INVALID_ARGUMENT and the replica serves on."""

    def __init__(self, engine: EngineLoop, model_info: pb.GetModelInfoResponse,
                 default_eos_token_ids: list[int]) -> None:
        self.engine = engine
        self.model_info = model_info
        self.default_eos = default_eos_token_ids
        self._streams: dict[str, _RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.draining = False  # set by drain.py: refuse new requests, finish the rest
        # Disaggregation (kv_role.py): consumes a request's kv_transfer_params.
        self.kv_transfer = None
        self.held_adapters = HeldAdapters(model_info.max_cpu_loras)

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    @property
    def num_in_flight(self) -> int:
        """Requests whose streams are open (accepted or being accepted)."""
        return len(self._streams)

    # ------------------------------------------------------------ engine thread -> loop
    def on_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def on_failure(self, exc: Exception) -> None:
        logger.error("replica failed: %s; its %d streams end for migration", exc,
                     len(self._streams))
        self._loop.call_soon_threadsafe(self._end_all, "The replica failed.", "replica_failed",
                                        False)

    def on_request_failed(self, request_id: str, reason: str, invalid: bool) -> None:
        """One request failed (the replica goes on); the request is already finished in
        the engine. Its stream ends INTERNAL when the worker failed it, INVALID_ARGUMENT
        with the reason when the request itself was at fault (its constraint did not
        compile): the client's 400, whose text is the verdict on its request."""
        logger.error("request %s failed: %s", request_id, reason)
        self._loop.call_soon_threadsafe(self._end_one, request_id, reason, invalid)

    def _end_one(self, request_id: str, reason: str, invalid: bool) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.fail((reason, INVALID, False) if invalid else
                        ("The model replica could not run this request.", None, False))

    def _dispatch(self, outputs: list[EngineCoreOutput]) -> None:
        dispatch(self._streams, outputs)

    def _end_all(self, message: str, reason: str, engine_alive: bool) -> None:
        for stream in list(self._streams.values()):
            stream.fail((message, reason, engine_alive))

    # ------------------------------------------------------------ RPCs
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        stream = _RequestStream()
        refusal = await self.accept(request, stream)
        if refusal is not None:
            await context.abort(*refusal)
        rid = request.request_id
        finished = delivered = False
        try:
            while not finished:
                await stream.ready.wait()
                stream.ready.clear()
                if stream.error is not None:
                    finished = not stream.error[2]  # a live engine frees its blocks (finally)
                    code, message, reason = error_status(stream.error)
                    await context.abort(code, message, trailing_metadata=(
                        ((MIGRATION_REASON_KEY, reason),) if reason else ()))
                batch, stream.pending = stream.pending, []
                if not batch:
                    continue
                finished = batch[-1].finished
                for response in outputs_to_responses(batch):
                    yield response
                delivered = finished  # the last output (naming a lease) went out
        finally:
            self.release(rid, finished, delivered)

    async def GenerateStream(self, request_iterator, context: grpc.aio.ServicerContext):
        """Many requests over one stream (generate_mux.py)."""
        # At once: the gateway writes nothing before it knows this replica has the RPC.
        await context.send_initial_metadata(())
        connection = MuxConnection(self, request_iterator)
        async for batch in connection.run():
            yield batch

    async def accept(self, request: pb.GenerateRequest, stream, traced: bool = True
                     ) -> tuple[grpc.StatusCode, str] | None:
        """Check `request` and submit it to the engine, `stream` registered under its id
        from the check on. None once the engine accepted it (the caller then owns the
        registration: `release` it); else the status that refuses it, with nothing left
        registered or held."""
        if self.engine.failure is not None:
            return grpc.StatusCode.UNAVAILABLE, "The replica failed."
        if self.draining:  # refused before acceptance: the gateway retries elsewhere
            return grpc.StatusCode.UNAVAILABLE, "replica is draining"
        if self.engine.core.sleep.is_sleeping:  # the engine refuses it too (a race)
            return grpc.StatusCode.FAILED_PRECONDITION, _sleeping_message()
        try:  # trusted because it came from inside? No: checked like outside input
            core_request = request_from_proto(request)
            if not core_request.eos_token_ids:
                core_request.eos_token_ids = list(self.default_eos)
            check_request(core_request, self.engine.core.config, from_wire=True)
            if core_request.mm_features:
                count_media_input(core_request)
        except (ValueError, TypeError, AssertionError) as exc:
            return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
        rid = core_request.request_id
        if rid in self._streams:
            return grpc.StatusCode.ALREADY_EXISTS, f"request id {rid!r} is in use"
        self._streams[rid] = stream
        if core_request.lora_request is not None:
            self.held_adapters.touch(core_request.lora_request.lora_name)
        if traced:  # its steps and phases join the caller's trace (the call's span)
            REQUEST_SPANS.register_current(rid)
        accepted = False
        try:
            if self.kv_transfer is not None:
                await self.kv_transfer.before_submit(core_request)
            error = await self._submit(core_request)
            if error is None:
                accepted = True
                return None
            if isinstance(error, sleep_control.EngineSleeping):
                return (grpc.StatusCode.FAILED_PRECONDITION,
                        f"{sleep_control.SLEEPING_MESSAGE}: {error}")
            code = (grpc.StatusCode.INVALID_ARGUMENT if isinstance(error, ValueError)
                    else grpc.StatusCode.RESOURCE_EXHAUSTED if isinstance(error, QueueFull)
                    else grpc.StatusCode.UNAVAILABLE)
            return code, str(error)
        finally:
            if not accepted:  # refused (nothing to abort), or cancelled while submitting
                self.release(rid, finished=not _cancelling(), delivered=False)

    def release(self, rid: str, finished: bool, delivered: bool) -> None:
        """The end of an accepted request's stream: forget it; abort it in the engine
        unless it `finished` there (cancelled by the client: disconnect, stop string)."""
        self._streams.pop(rid, None)
        REQUEST_SPANS.unregister(rid)
        if self.kv_transfer is not None:
            self.kv_transfer.after_stream(rid, delivered)
        if not finished:
            self.engine.abort([rid])

    async def _submit(self, core_request) -> Exception | None:
        accepted = self._loop.create_future()

        def on_accept(error: Exception | None) -> None:
            self._loop.call_soon_threadsafe(_resolve, accepted, error)

        self.engine.submit(core_request, on_accept)
        return await accepted

    def migrate_all(self) -> int:
        """End every stream in flight UNAVAILABLE with reason drain_timeout (a drain that
        ran out of time): the gateways continue the requests on other replicas, and each
        handler aborts its request here as it exits, freeing its blocks."""
        self._end_all("The replica is shutting down.", "drain_timeout", True)
        return len(self._streams)

    async def AbortRequests(self, request: pb.AbortRequestsRequest, context
                            ) -> pb.AbortRequestsResponse:
        self.engine.abort(list(request.request_ids))
        return pb.AbortRequestsResponse()

    async def GetLoad(self, request: pb.GetLoadRequest, context) -> pb.GetLoadResponse:
        s = self.engine.stats
        return pb.GetLoadResponse(
            num_running=s.num_running, num_waiting=max(s.num_waiting, self.engine.num_waiting),
            kv_cache_usage=s.kv_cache_usage, prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits, num_preemptions=s.num_preemptions,
            serving=self.engine.failure is None and not self.draining, draining=self.draining,
            lora_adapters=self.held_adapters.names(), epoch=self.model_info.epoch)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context
                           ) -> pb.GetModelInfoResponse:
        return self.model_info

    async def CheckLoRAAdapter(self, request, context) -> pb.CheckLoRAAdapterResponse:
        try:
            lora = LoRARequest(request.lora_name, request.lora_int_id, request.lora_path)
            rank = check_lora(lora, self.engine.core.config)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.CheckLoRAAdapterResponse(rank=rank)

    async def HashBlocks(self, request: pb.HashBlocksRequest, context) -> pb.HashBlocksResponse:
        try:
            return hash_blocks(request, self.model_info.prefix_hash_seed,
                               self.model_info.prefix_caching_hash_algo)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def GetCachedBlocks(self, request: pb.GetCachedBlocksRequest, context
                              ) -> pb.GetCachedBlocksResponse:
        if self.engine.failure is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "The replica failed.")
        done = self._loop.create_future()
        core = self.engine.core
        self.engine.call_soon(lambda: self._loop.call_soon_threadsafe(
            _resolve, done, core.cached_block_hashes()))
        hashes = await asyncio.wait_for(done, timeout=30.0)
        return pb.GetCachedBlocksResponse(block_hashes=hashes, epoch=self.model_info.epoch)

    # ------------------------------------------------------------ sleep mode
    async def SleepEngine(self, request: pb.SleepEngineRequest, context
                          ) -> pb.SleepEngineResponse:
        core = await self._sleep_mode_core(context)
        try:
            await sleep_control.on_engine_thread(
                self.engine, lambda: sleep_control.sleep(core, request.level), _SLEEP_CALL_TIMEOUT_S)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except RuntimeError as exc:  # requests in flight, already asleep, the worker's no
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        logger.info("the engine sleeps (level %d)", request.level or 1)
        return pb.SleepEngineResponse()

    async def WakeUpEngine(self, request: pb.WakeUpEngineRequest, context
                           ) -> pb.WakeUpEngineResponse:
        core = await self._sleep_mode_core(context)
        tags = list(request.tags) or None
        try:
            sleeping = await sleep_control.on_engine_thread(
                self.engine, lambda: sleep_control.wake_up(core, tags), _SLEEP_CALL_TIMEOUT_S)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except (RuntimeError, NotImplementedError) as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        logger.info("the engine woke up (%s)", ", ".join(tags or ["all"]))
        return pb.WakeUpEngineResponse(is_sleeping=sleeping)

    async def GetSleepState(self, request: pb.GetSleepStateRequest, context
                            ) -> pb.GetSleepStateResponse:
        sleeping, level, asleep = sleep_control.sleep_state(self.engine.core)
        return pb.GetSleepStateResponse(is_sleeping=sleeping, level=level, asleep=asleep)

    async def _sleep_mode_core(self, context):
        """The engine core, if sleep mode is on and the engine alive (else the call ends)."""
        if self.engine.failure is not None:  # its thread is gone: nothing would run the call
            await context.abort(grpc.StatusCode.UNAVAILABLE, "The replica failed.")
        if not self.engine.core.config.enable_sleep_mode:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, _SLEEP_MODE_OFF)
        return self.engine.core


# Offloading or reloading the weights of a large model takes a while; a bound all the same.
_SLEEP_CALL_TIMEOUT_S = 600.0
_SLEEP_MODE_OFF = "Sleep mode is not enabled: start the replica with --enable-sleep-mode"


def _sleeping_message() -> str:
    return f"{sleep_control.SLEEPING_MESSAGE}: call /wake_up first"


def _cancelling() -> bool:
    """Whether the current task is being cancelled (its caller went away)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _resolve(future: asyncio.Future, error: Exception | None) -> None:
    if not future.done():
        future.set_result(error)
