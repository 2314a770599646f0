"""One completion (one OpenAI choice) end to end: scheduler stream -> decode -> text deltas.

Token ids come from the scheduler; text comes from the tokenizer's DecodeStream,
which also matches stop strings. When a stop string ends the text, the request is
aborted in the scheduler (closing the stream cancels the call) and the tokens
after the one that completed the match are dropped, so usage counts only the
tokens the client's text came from.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc

from pagoda._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as tpb
from pagoda.engine.core_types import EngineCoreRequest
from pagoda.protocol.tokenizer import decode_options_to_proto
from pagoda.services.gateway.decode_mux import DecodeMux, DecodeStreamBroken
from pagoda.services.gateway.errors import APIError, from_grpc_error
from pagoda.services.gateway.peers import SchedulerReplica


@dataclass
class ChoiceDelta:
    """New text of one choice; `finish_reason` set on its last delta."""

    index: int
    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0


async def stream_choice(replica: SchedulerReplica, mux: DecodeMux, request: EngineCoreRequest,
                        index: int) -> AsyncIterator[ChoiceDelta]:
    """Yield the choice's deltas; the last one has a finish_reason. Raises APIError."""
    rid = request.request_id
    options = decode_options_to_proto(request.prompt_token_ids, request.sampling_params)
    outputs = replica.generate(request)
    first, complete = True, False
    try:
        async for out in outputs:
            item = tpb.DecodeInput(request_id=rid, token_ids=out.new_token_ids,
                                   finished=out.finished)
            if first:
                item.options.CopyFrom(options)
                first = False
            result = await mux.decode(item)
            if result.HasField("chunk"):
                yield ChoiceDelta(index, result.chunk.text, out.new_token_ids,
                                  num_cached_tokens=out.num_cached_tokens)
                continue
            complete = True
            done = result.complete
            if done.stop_string:
                yield ChoiceDelta(index, done.text, out.new_token_ids[:done.num_tokens_used],
                                  "stop", done.stop_string, out.num_cached_tokens)
            else:
                yield ChoiceDelta(index, done.text, out.new_token_ids, str(out.finish_reason),
                                  out.stop_reason, out.num_cached_tokens)
            return
        raise APIError("The scheduler ended the request without finishing it.", 500)
    except grpc.RpcError as exc:
        raise from_grpc_error(exc, f"scheduler {replica.address}") from None
    except DecodeStreamBroken as exc:
        raise APIError(f"tokenizer failed: {exc}", 503) from None
    finally:
        await outputs.aclose()  # cancels the call: the scheduler aborts the request
        if not complete and not first:
            mux.release(rid)


async def merge_choices(streams: Sequence[AsyncIterator[ChoiceDelta]]
                        ) -> AsyncIterator[ChoiceDelta]:
    """Interleave several choices' deltas as they come; the first error wins and
    cancels the others."""
    if len(streams) == 1:
        async for delta in streams[0]:
            yield delta
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream: AsyncIterator[ChoiceDelta]) -> None:
        try:
            async for delta in stream:
                await queue.put(delta)
            await queue.put(done)
        except BaseException as exc:  # noqa: BLE001 (re-raised in the consumer)
            await queue.put(exc)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
