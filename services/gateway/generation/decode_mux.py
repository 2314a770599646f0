"""Many completions' incremental decode over one `DecodeStream` to the tokenizer.

Per-token messages would cost a gRPC round trip per token per request; instead
every completion's pending deltas ride in one batch. While a batch is in flight,
new deltas queue up and go out together as the next batch (lock-step: one batch
in flight), so the number of round trips per engine step stays ~1 whatever the
concurrency.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as pb
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2_grpc as pb_grpc
from pagoda.services.common import grpc_channels

logger = logging.getLogger(__name__)


class DecodeStreamBroken(Exception):
    """The tokenizer stream failed; the completions decoding on it cannot continue there.
    `stream_lost`: the stream itself is gone (its tokenizer died or closed it), so a
    completion may start over on the next one (decode_resume.py)."""

    def __init__(self, message: str, stream_lost: bool = True) -> None:
        super().__init__(message)
        self.stream_lost = stream_lost


class DecodeMux:
    """`await decode(input)` -> its DecodeResult (None for a `release`).

    Invariant: each completion has at most one input in flight (callers await
    their result before sending the next), so results map back by request id.
    """

    def __init__(self, stub: pb_grpc.TokenizerServiceStub) -> None:
        self._stub = stub
        self._pending: list[tuple[pb.DecodeInput, asyncio.Future | None]] = []
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._generation = 0  # bumps when the stream is replaced; old decoders are gone

    async def decode(self, item: pb.DecodeInput) -> pb.DecodeResult:
        future = asyncio.get_running_loop().create_future()
        self._enqueue(item, future)
        return await future

    def release(self, request_id: str) -> None:
        """Forget a completion (fire and forget: nothing to wait for)."""
        self._enqueue(pb.DecodeInput(request_id=request_id, release=True), None)

    def _enqueue(self, item: pb.DecodeInput, future: asyncio.Future | None) -> None:
        self._pending.append((item, future))
        self._wakeup.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass

    async def _run(self) -> None:
        call = self._stub.DecodeStream()
        try:
            while True:
                await self._wakeup.wait()
                self._wakeup.clear()
                batch, self._pending = self._pending, []
                if batch:
                    await self._exchange(call, batch)
        except asyncio.CancelledError:
            call.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - whatever ends the stream fails its waiters
            # (an RpcError, the EOF, or InvalidStateError from a write to a stream that
            # died while idle): none may be left waiting on a task that is gone.
            call.cancel()
            logger.error("tokenizer decode stream failed: %r", exc)
            self._fail_all(exc)

    async def _exchange(self, call, batch) -> None:
        try:
            await call.write(pb.DecodeStreamRequest(inputs=[item for item, _ in batch]))
            response = await grpc_channels.read_within(
                call, grpc_channels.DECODE_READ_TIMEOUT_S, "the tokenizer")
        except (grpc.RpcError, asyncio.InvalidStateError) as exc:  # the latter: it had ended
            self._fail(batch, exc)
            raise
        if response is grpc.aio.EOF:
            exc = DecodeStreamBroken("tokenizer closed the decode stream")
            self._fail(batch, exc)
            raise exc
        results = {r.request_id: r for r in response.results}
        for item, future in batch:
            if future is not None and not future.done():
                result = results.get(item.request_id)
                if result is None:
                    future.set_exception(DecodeStreamBroken(f"no result for {item.request_id}",
                                                            stream_lost=False))
                else:
                    future.set_result(result)

    def _fail_all(self, exc: Exception) -> None:
        batch, self._pending = self._pending, []
        self._fail(batch, exc)

    @staticmethod
    def _fail(batch, exc: Exception) -> None:
        for _, future in batch:
            if future is not None and not future.done():
                future.set_exception(DecodeStreamBroken(str(exc)))
