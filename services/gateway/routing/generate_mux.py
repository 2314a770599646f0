"""The gateway's side of `GenerateStream`: every request to one replica over one stream.

    outputs(request) ──► outbox ──writer task──► GenerateStreamRequest(requests, aborts)
    outputs(request) ◄── its receiver ◄──reader task── GenerateStreamBatch (one per step)

Per-request `Generate` costs the replica one message (and the gateway one read) per
request per engine step; here a step is one message per connection whatever the batch
(the tokenizer's decode_mux.py does the same for detokenizing). `outputs(request)` is
what `Generate` gave the rest of the gateway: the request's outputs in order, ending
after the finished one, or a `grpc.RpcError` with the status its `Generate` call
would have ended with (an `error` item; or the stream's own failure, shared by every
request on it, so a replica that dies fails them all UNAVAILABLE as their calls did).
Closing the iterator early aborts the request on the replica, and nothing else.

Invariants:
  * a request has a receiver from `outputs` until its end (complete or error) was
    read, it was closed, or the stream failed;
  * a stream that failed takes no new request: the next one opens a new stream;
  * a replica that answers UNIMPLEMENTED (it predates the RPC) fails its requests with
    `StreamUnsupported` before any output, and `supported` turns False: the caller
    sends them, and later ones, as per-request `Generate` calls (rolling upgrades);
  * a request that receives nothing for GENERATE_READ_TIMEOUT_S fails UNAVAILABLE
    and is aborted, as `read_within` fails a silent `Generate` call.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from pagoda import envs
from pagoda.messages import EngineCoreOutput, EngineCoreRequest
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2 as pb
from pagoda.services.common import grpc_channels
from pagoda.services.common.protocol.scheduler import (MIGRATION_REASON_KEY, request_to_proto,
                                                       response_to_output)

logger = logging.getLogger(__name__)
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def generate_stream_enabled() -> bool:
    """Whether requests go over `GenerateStream`: yes unless PAGODA_GENERATE_STREAM=0
    (per-request `Generate` calls, for comparing the two)."""
    return envs.get("PAGODA_GENERATE_STREAM")


class StreamUnsupported(Exception):
    """The replica does not implement `GenerateStream`: use `Generate`."""


def rpc_error(code: grpc.StatusCode, details: str, trailing: tuple = ()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details)


class _Receiver:
    """One request's outputs as the reader delivers them. `wake()` after each change:
    it resolves the waiter the request's `outputs` is parked on, if any (a bare
    future per wait, not an asyncio.Event: this runs for every token)."""

    __slots__ = ("items", "waiter", "error", "seen", "last")

    def __init__(self, now: float) -> None:
        self.items: list[pb.GenerateStreamItem | EngineCoreOutput] = []
        self.waiter: asyncio.Future | None = None
        self.error: BaseException | None = None  # the stream's failure (after `items`)
        self.seen = False  # an item arrived since the last silence check
        self.last = now  # when the silence check last saw it hear something

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)


class _Connection:
    """One `GenerateStream` call and the requests on it."""

    def __init__(self, stub, mux: "GenerateMux") -> None:
        self._mux = mux
        self.call = stub.GenerateStream()
        self.receivers: dict[str, _Receiver] = {}
        self._new: dict[str, pb.GenerateRequest] = {}  # not written yet
        self._aborts: list[str] = []
        self._wakeup = asyncio.Event()
        self.failed: BaseException | None = None
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._write()), loop.create_task(self._read()),
                       loop.create_task(self._watch())]

    def add(self, request: EngineCoreRequest) -> _Receiver:
        receiver = _Receiver(asyncio.get_running_loop().time())
        self.receivers[request.request_id] = receiver
        self._new[request.request_id] = request_to_proto(request)
        self._wakeup.set()
        return receiver

    def abort(self, rid: str) -> None:
        """Forget `rid`; the replica aborts it (unless it was never sent)."""
        if self.receivers.pop(rid, None) is None or self.failed is not None:
            return
        if self._new.pop(rid, None) is None:
            self._aborts.append(rid)
            self._wakeup.set()

    async def _write(self) -> None:
        try:
            # Nothing is written before the replica answers the call (its initial
            # metadata, sent at once): a write racing a replica's UNIMPLEMENTED would turn
            # the call's status into INTERNAL, and the fallback to `Generate` would not run.
            await self.call.initial_metadata()
            if self.call.done():
                return  # refused: the reader reports the status
            while True:
                await self._wakeup.wait()
                self._wakeup.clear()
                if not (self._new or self._aborts):
                    continue
                message = pb.GenerateStreamRequest(requests=list(self._new.values()),
                                                   abort_request_ids=self._aborts)
                self._new, self._aborts = {}, []
                await self.call.write(message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a write to a stream that ended
            # The write's own error says little ("Internal error from Core"): the reader
            # fails the requests with the stream's status. Should it not, within a
            # bound, fail them here so that nobody waits forever.
            try:
                await asyncio.wait_for(asyncio.shield(self._tasks[1]), 5.0)
            except Exception:  # noqa: BLE001 - timed out, or the reader's own end
                pass
            self._fail(rpc_error(grpc.StatusCode.UNAVAILABLE,
                                 f"the generate stream failed: {exc!r}"))

    async def _read(self) -> None:
        receivers = self.receivers
        try:
            while (batch := await self.call.read()) is not grpc.aio.EOF:
                if batch.token_request_ids:
                    self._deliver_columns(batch)
                for item in batch.items:
                    receiver = receivers.get(item.request_id)
                    if receiver is None:
                        continue  # closed by its reader: its abort is on the way
                    if not item.HasField("chunk"):  # its end: no item follows
                        del receivers[item.request_id]
                    receiver.items.append(item)
                    receiver.seen = True
                    receiver.wake()
            self._fail(rpc_error(grpc.StatusCode.UNAVAILABLE,
                                 "the scheduler closed the generate stream"))
        except asyncio.CancelledError:
            raise
        except grpc.RpcError as exc:
            self._fail(exc)
        except Exception as exc:  # noqa: BLE001 - whatever ends the read fails its requests
            logger.exception("generate stream read failed")
            self._fail(rpc_error(grpc.StatusCode.UNAVAILABLE,
                                 f"the generate stream failed: {exc!r}"))

    def _deliver_columns(self, batch: pb.GenerateStreamBatch) -> None:
        """The batch's token columns, each request's as the output its chunk would be."""
        receivers = self.receivers
        tokens = list(batch.token_ids)
        start = 0
        for rid, count, cached in zip(batch.token_request_ids, batch.token_counts,
                                      batch.num_cached_tokens):
            end = start + count
            receiver = receivers.get(rid)
            if receiver is not None:
                receiver.items.append(EngineCoreOutput(rid, tokens[start:end],
                                                       num_cached_tokens=cached))
                receiver.seen = True
                receiver.wake()
            start = end

    async def _watch(self) -> None:
        """Fail requests the replica stays silent on (see the module's invariants)."""
        loop = asyncio.get_running_loop()
        while True:
            timeout = grpc_channels.GENERATE_READ_TIMEOUT_S
            await asyncio.sleep(min(timeout / 10, 1.0))
            now = loop.time()
            for rid, receiver in list(self.receivers.items()):
                if receiver.seen:
                    receiver.seen, receiver.last = False, now
                elif now - receiver.last > timeout:
                    self.abort(rid)
                    receiver.error = rpc_error(grpc.StatusCode.UNAVAILABLE,
                                               f"the scheduler sent nothing for {timeout:g} s")
                    receiver.wake()

    def _fail(self, exc: BaseException) -> None:
        if self.failed is not None:
            return
        if isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            self._mux.supported = False
            logger.info("scheduler %s has no GenerateStream: using Generate per request",
                        self._mux.address)
            exc = StreamUnsupported(exc.details())
        elif self.receivers:
            logger.warning("generate stream to %s failed with %d requests on it: %s",
                           self._mux.address, len(self.receivers), exc)
        self.failed = exc
        self._mux.forget(self)
        receivers, self.receivers = self.receivers, {}
        for receiver in receivers.values():
            receiver.error = exc
            receiver.wake()
        self.call.cancel()
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()

    def close(self) -> None:
        self._fail(rpc_error(grpc.StatusCode.CANCELLED, "the gateway closed the stream"))


class GenerateMux:
    """`outputs(request)` over this replica's one `GenerateStream` (opened on demand).
    `supported`: None until the replica answered, False once it said UNIMPLEMENTED."""

    def __init__(self, stub, address: str) -> None:
        self._stub = stub
        self.address = address
        self.supported: bool | None = None
        self._connection: _Connection | None = None

    def forget(self, connection: _Connection) -> None:
        if self._connection is connection:
            self._connection = None

    def reset(self) -> None:
        """The replica restarted (maybe upgraded): ask again whether it has the RPC."""
        if self.supported is False:
            self.supported = None

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()

    async def outputs(self, request: EngineCoreRequest) -> AsyncIterator[EngineCoreOutput]:
        """Raises grpc.RpcError as its `Generate` call would, StreamUnsupported before
        any output when the replica lacks the RPC."""
        connection = self._connection
        if connection is None:
            connection = self._connection = _Connection(self._stub, self)
        rid = request.request_id
        loop = asyncio.get_running_loop()
        receiver = connection.add(request)
        finished = False
        try:
            while True:
                while not receiver.items:
                    if receiver.error is not None:
                        raise _copy(receiver.error)
                    receiver.waiter = loop.create_future()
                    await receiver.waiter
                items, receiver.items = receiver.items, []
                for item in items:
                    if type(item) is EngineCoreOutput:  # from the token columns
                        yield item
                        continue
                    if item.HasField("error"):
                        finished = True
                        raise _item_error(item.error)
                    out = response_to_output(rid, item)
                    finished = out.finished
                    yield out
                    if finished:
                        return
        finally:
            if not finished:
                connection.abort(rid)


def _copy(exc: BaseException) -> BaseException:
    """A stream's failure, raised anew in each request that was on it."""
    if isinstance(exc, StreamUnsupported):
        return StreamUnsupported(str(exc))
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "trailing_metadata"):
        return rpc_error(exc.code(), exc.details(), tuple(exc.trailing_metadata() or ()))
    return exc


def _item_error(error: pb.GenerateError) -> grpc.aio.AioRpcError:
    code = _CODES.get(error.code, grpc.StatusCode.UNKNOWN)
    trailing = (((MIGRATION_REASON_KEY, error.migration_reason),)
                if error.migration_reason else ())
    return rpc_error(code, error.message, trailing)
