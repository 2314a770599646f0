"""POST /v1/completions and /v1/chat/completions, streamed (SSE) and not."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagoda._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as tpb
from pagoda.protocol.tokenizer import chat_input_to_proto
from pagoda.services.gateway.choices import ChoiceDelta
from pagoda.services.gateway.errors import APIError, from_grpc_error
from pagoda.services.gateway.generation import Generation, Prompt, new_request_id
from pagoda.services.gateway.openai_models import ChatCompletionRequest, CompletionRequest
from pagoda.services.gateway.responses import (DONE, ChoiceText, ResponseHeader, chat_body,
                                               chat_chunk, completion_body, completion_chunk,
                                               sse, usage_chunk)
from pagoda.services.gateway.state import GatewayState
from pagoda.tokenizer.chat import normalize_messages

logger = logging.getLogger(__name__)
router = APIRouter()
# How often a non-streamed request checks that its client is still there.
DISCONNECT_POLL_S = 0.5


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request):
    state: GatewayState = request.app.state.gateway
    model = state.check_model(body.model)
    prompts = await tokenize_prompts(state, body.prompt)
    gen = Generation(state.peers, new_request_id("cmpl"), prompts, body, body.max_tokens)
    head = ResponseHeader(gen.request_id, model)
    echo = [p.text or "" for p in prompts for _ in range(body.n)] if body.echo else None
    if body.stream:
        return await stream_response(
            gen, lambda d: [completion_chunk(head, d)] if d.text or d.finish_reason else [],
            head, "text_completion", body)
    choices = await collect(gen, request)
    return JSONResponse(completion_body(head, choices, gen.usage, echo))


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    state: GatewayState = request.app.state.gateway
    model = state.check_model(body.model)
    try:
        messages = normalize_messages(body.messages)
    except ValueError as exc:
        raise APIError(str(exc), param="messages") from None
    chat = chat_input_to_proto(messages, body.add_generation_prompt, body.continue_final_message,
                               body.chat_template_kwargs, body.tools)
    reply = await tokenize(state, tpb.TokenizeRequest(chat=chat))
    max_tokens = body.max_completion_tokens or body.max_tokens
    gen = Generation(state.peers, new_request_id("chatcmpl"),
                     [Prompt(list(reply.token_ids), reply.prompt)], body, max_tokens)
    head = ResponseHeader(gen.request_id, model)
    if body.stream:
        started: set[int] = set()

        def chunks(d: ChoiceDelta) -> list[dict]:
            out = []
            if d.index not in started:  # the first chunk of a choice names the role
                started.add(d.index)
                out.append(chat_chunk(head, d.index, {"role": "assistant", "content": ""}))
            if d.text:
                out.append(chat_chunk(head, d.index, {"content": d.text}))
            if d.finish_reason is not None:
                out.append(chat_chunk(head, d.index, {}, d.finish_reason, d.stop_reason))
            return out

        return await stream_response(gen, chunks, head, "chat.completion.chunk", body)
    choices = await collect(gen, request)
    return JSONResponse(chat_body(head, choices, gen.usage))


async def tokenize(state: GatewayState, request: tpb.TokenizeRequest) -> tpb.TokenizeResponse:
    state.peers.tokenizer_info()  # 503 until the tokenizer serves
    try:
        return await state.peers.tokenizer.stub.Tokenize(request, timeout=60.0)
    except grpc.RpcError as exc:
        raise from_grpc_error(exc, "tokenizer") from None


async def tokenize_prompts(state: GatewayState, prompt) -> list[Prompt]:
    """A string, a list of strings, token ids, or a list of token-id lists."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError("The prompt cannot be empty.", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [Prompt(list(prompt))]
    prompts = []
    for p in prompt:
        if isinstance(p, str):
            reply = await tokenize(state, tpb.TokenizeRequest(prompt=p, add_special_tokens=True))
            prompts.append(Prompt(list(reply.token_ids), p))
        else:
            prompts.append(Prompt(list(p)))
    return prompts


async def collect(gen: Generation, request: Request) -> list[ChoiceText]:
    """Run a non-streamed request to the end, or abort it if the client goes away
    (cancelling the task closes the scheduler streams, which aborts the requests)."""

    async def run() -> list[ChoiceText]:
        choices = [ChoiceText() for _ in range(gen.num_choices)]
        async for delta in gen.deltas():
            choices[delta.index].add(delta)
        return choices

    task = asyncio.create_task(run())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise APIError("The client disconnected.", 499)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def stream_response(gen: Generation, to_chunks, head: ResponseHeader, obj: str, body
                          ) -> StreamingResponse:
    """SSE of every delta, then usage (if asked) and `data: [DONE]`.

    The first delta is awaited before the response starts, so errors found on
    submission (bad input, no replica) are a plain HTTP error, not an SSE event.
    """
    deltas = gen.deltas()
    first = await anext(deltas)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def events() -> AsyncIterator[bytes]:
        try:
            for chunk in to_chunks(first):
                yield sse(chunk)
            async for delta in deltas:
                for chunk in to_chunks(delta):
                    yield sse(chunk)
            if include_usage:
                yield sse(usage_chunk(head, obj, gen.usage))
        except APIError as exc:
            yield sse(exc.body())
        except Exception as exc:  # noqa: BLE001 (the client gets an error event, never a hang)
            logger.exception("stream failed")
            yield sse(APIError(f"internal error: {exc}", 500).body())
        finally:
            await deltas.aclose()
        yield DONE

    return StreamingResponse(events(), media_type="text/event-stream")
