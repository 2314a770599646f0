"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API.

A request becomes a chat completion (conversion.py) that the chat route's `start_chat`
checks, tokenizes and turns into a Generation: limits, validation, sampling, routing and
abort on disconnect are chat's. Only the shapes are this room's: the message and its
SSE events (output.py) and the error JSON (errors.py, installed by app.py for every
path under /v1/messages). As on the chat route, errors found before the first token are
a plain HTTP error; a failure mid-stream is an `error` event that ends the stream.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as tpb
from pagoda.services.gateway.anthropic.conversion import to_chat_request
from pagoda.services.gateway.anthropic.errors import anthropic_error_body
from pagoda.services.gateway.anthropic.output import (BlockEvents, content_blocks, message_object,
                                                      sse_event, stop_reason)
from pagoda.services.gateway.anthropic.request_models import (CountTokensRequest, MessagesInput,
                                                              MessagesRequest)
from pagoda.services.gateway.errors import APIError, internal_error_message
from pagoda.services.gateway.generation.choices import ChoiceDelta
from pagoda.services.gateway.generation.fan_out import Generation
from pagoda.services.gateway.openai import routes as chat_routes
from pagoda.services.gateway.openai.request_models import ChatCompletionRequest
from pagoda.services.gateway.state import GatewayState
from pagoda.services.gateway.web.direct_body import DirectStreamingResponse

logger = logging.getLogger(__name__)
router = APIRouter()
# The path prefix whose errors are in Anthropic's shape.
PATH_PREFIX = "/v1/messages"


@router.post("/v1/messages")
async def create_message(body: MessagesRequest, request: Request):
    state: GatewayState = request.app.state.gateway
    body.check()
    chat = converted(state, body)
    run = await chat_routes.start_chat(state, chat, request, id_prefix="msg")
    message_id = f"msg_{uuid.uuid4().hex}"
    if body.stream:
        deltas = run.gen.deltas()
        first = await chat_routes.until_disconnected(anext(deltas), request)
        events = BlockEvents(run.output)
        return DirectStreamingResponse(
            _events(run.gen, events, first, deltas,
                    message_object(message_id, body.model, [], (None, None),
                                   run.gen.usage.prompt_tokens, 0)),
            media_type="text/event-stream")
    choice = (await chat_routes.collect(run.gen, request))[0]
    blocks, finish_reason = content_blocks(run.output, choice.text, choice.finish_reason)
    return JSONResponse(message_object(
        message_id, body.model, blocks, stop_reason(finish_reason, choice.stop_reason),
        run.gen.usage.prompt_tokens, run.gen.usage.completion_tokens))


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request):
    """The prompt's token count, as the chat template renders it for /v1/messages."""
    state: GatewayState = request.app.state.gateway
    chat = converted(state, body)
    state.check_model(chat.model)
    lora = state.lora_request(chat.model)
    chat_routes.check_chat_request(state, chat)
    chat_routes.chat_output(state, chat)  # the tools and tool_choice checks
    _, chat_input = chat_routes.chat_input(chat.messages, True, False, chat.chat_template_kwargs,
                                           chat.tools)
    reply = await chat_routes.tokenize(state, tpb.TokenizeRequest(
        chat=chat_input, lora_key=lora.cache_key if lora else ""))
    return JSONResponse({"input_tokens": len(reply.token_ids)})


def converted(state: GatewayState, body: MessagesInput) -> ChatCompletionRequest:
    """`body` as a chat request, after the limits a chat body has (--max-messages,
    nesting) on the request as sent: the converted one is checked again by start_chat."""
    state.options.limits.check_messages(
        body.messages, system=body.system, metadata=getattr(body, "metadata", None),
        tools=[t.input_schema for t in body.tools or ()])
    return to_chat_request(body)


async def _events(gen: Generation, blocks: BlockEvents, first: ChoiceDelta,
                  deltas: AsyncIterator[ChoiceDelta], start: dict) -> AsyncIterator[bytes]:
    yield sse_event("message_start", message=start)
    yield sse_event("ping")
    try:
        delta = first
        while delta is not None:
            for event in blocks.feed(delta.text, delta.finish_reason):
                yield event
            if delta.finish_reason is not None:
                reason, sequence = stop_reason(blocks.finish_reason(delta.finish_reason),
                                               delta.stop_reason)
                yield sse_event("message_delta",
                                delta={"stop_reason": reason, "stop_sequence": sequence},
                                usage={"output_tokens": gen.usage.completion_tokens})
                yield sse_event("message_stop")
            delta = await anext(deltas, None)
    except APIError as exc:
        yield sse_event("error", **_error(exc.message, exc.status))
    except Exception as exc:  # noqa: BLE001 (the client gets an error event, never a hang)
        logger.exception("messages stream failed")
        yield sse_event("error", **_error(internal_error_message(exc), 500))
    finally:
        await deltas.aclose()


def _error(message: str, status: int) -> dict:
    return {"error": anthropic_error_body(message, status)["error"]}
