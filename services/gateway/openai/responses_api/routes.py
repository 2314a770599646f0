"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API on the chat path.

A request becomes chat messages (instructions, the stored conversation of
`previous_response_id`, the input) and a chat completion (models.py), which
is tokenized, routed and generated exactly as /v1/chat/completions does. The answer is
one assistant message item; streamed, it is OpenAI's event sequence:

    response.created, response.in_progress, response.output_item.added,
    response.content_part.added, response.output_text.delta (one per text delta),
    response.output_text.done, response.content_part.done, response.output_item.done,
    response.completed

each an SSE `event:` line with its JSON `data:` (carrying `sequence_number`, 0, 1,
...). Errors found before generation starts are a plain HTTP error; a failure later
is an `error` event that ends the stream. With `store` (the default) the finished
response and its conversation go to the bounded store (store.py), where
`previous_response_id` and GET find them.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as tpb
from pagoda.services.gateway.errors import APIError
from pagoda.services.gateway.generation.choices import ChoiceDelta
from pagoda.services.gateway.generation.fan_out import Generation, Prompt
from pagoda.services.gateway.openai import routes as openai_routes
from pagoda.services.gateway.openai.logprobs import chat_logprobs
from pagoda.services.gateway.openai.request_models import ChatCompletionRequest
from pagoda.services.gateway.openai.responses_api.mcp_turn import mcp_entries, respond_with_tools
from pagoda.services.gateway.openai.responses_api.models import (ResponsesRequest, conversation,
                                                                 input_messages, output_message,
                                                                 output_text_part, response_object,
                                                                 to_chat_request, usage_object)
from pagoda.services.gateway.openai.responses_api.shared_store import SharedResponseStore
from pagoda.services.gateway.openai.responses_api.tool_server import MCPToolServer
from pagoda.services.gateway.openai.responses_api.store import (DEFAULT_MAX_STORED_RESPONSES,
                                                                ResponseStore, StoredResponse)
from pagoda.services.gateway.shared_state import shared_path
from pagoda.services.gateway.state import GatewayState

logger = logging.getLogger(__name__)
router = APIRouter()


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    state: GatewayState = request.app.state.gateway
    model = state.check_model(body.model)
    body.check()
    # The limits a chat body has, on the raw input before it is converted, and on the
    # whole conversation (stored turns included) after.
    raw_input = body.input if isinstance(body.input, list) else [body.input]
    state.options.limits.check_messages(raw_input, "input")
    store = response_store(request.app)
    history = []
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id)
        if previous is None:
            raise not_found(body.previous_response_id)
        history = previous.messages
    if mcp_entries(body):  # the gateway runs the tools (--tool-server)
        response, stored = await respond_with_tools(state, body, model,
                                                    conversation(body, history), request,
                                                    tool_server(request.app))
        if body.store:
            store.put(response["id"], StoredResponse(
                response, history + input_messages(body.input) + stored[
                    len(conversation(body, history)):]))
        return JSONResponse(response)
    chat = to_chat_request(body, conversation(body, history))
    openai_routes.check_chat_request(state, chat)
    chat.check_common(state.options.max_logprobs)
    turn = Turn(body, model, history + input_messages(body.input), store)
    gen = await start_generation(state, chat, turn.response_id)
    if body.stream:
        deltas = gen.deltas()
        first = await openai_routes.until_disconnected(anext(deltas), request)
        return StreamingResponse(turn.events(gen, first, deltas), media_type="text/event-stream")
    for choice in await openai_routes.collect(gen, request):
        turn.add(ChoiceDelta(0, choice.text, finish_reason=choice.finish_reason,
                             logprobs=choice.logprobs))
    return JSONResponse(turn.finish(gen))


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request):
    if not response_id.startswith("resp"):
        raise APIError(f"Invalid 'response_id': '{response_id}'. Expected an ID that begins "
                       f"with 'resp'.", param="response_id")
    item = response_store(request.app).get(response_id)
    if item is None:
        raise not_found(response_id)
    return JSONResponse(item.response)


def not_found(response_id: str) -> APIError:
    return APIError(f"Response with id '{response_id}' not found.", 404, param="response_id")


def tool_server(app: FastAPI) -> MCPToolServer | None:
    """The app's --tool-server client (None without the flag), made on first use."""
    server = getattr(app.state, "tool_server", None)
    entries = getattr(app.state.gateway.options, "tool_server", None)
    if server is None and entries:
        server = app.state.tool_server = MCPToolServer(entries.split(","))
    return server


def response_store(app: FastAPI) -> ResponseStore:
    """The app's store, sized by --max-stored-responses on first use; with
    --api-server-count > 1, the one every API server shares (shared_state.py)."""
    store = getattr(app.state, "response_store", None)
    if store is None:
        options = app.state.gateway.options
        capacity = getattr(options, "max_stored_responses", DEFAULT_MAX_STORED_RESPONSES)
        path = shared_path("responses.sqlite")  # several API servers: one store for all
        store = (SharedResponseStore(path, capacity) if path and capacity > 0
                 else ResponseStore(capacity))
        app.state.response_store = store
    return store


async def start_generation(state: GatewayState, chat: ChatCompletionRequest,
                           response_id: str) -> Generation:
    """Tokenize the conversation and build its generation, as the chat route does.
    `max_output_tokens` is clamped to the room the prompt leaves (vLLM's rule)."""
    _, chat_input = openai_routes.chat_input(chat.messages, True, False)
    lora = state.lora_request(chat.model)
    reply = await openai_routes.tokenize(state, tpb.TokenizeRequest(
        chat=chat_input, block_size=state.peers.routing_block_size(),
        cache_salt=chat.cache_salt or "", lora_key=lora.cache_key if lora else ""))
    prompt = Prompt(list(reply.token_ids), reply.prompt, list(reply.block_hashes) or None)
    requested = chat.requested_max_tokens()
    room = state.peers.model_info().max_model_len - len(prompt.token_ids)
    if requested is not None and room > 0:
        requested = min(requested, room)
    max_tokens = state.fill_defaults(chat, requested, [prompt])
    gen = Generation(state.peers, response_id, [prompt], chat, max_tokens, "input",
                     lora_request=lora)
    state.options.on_generation(gen)
    return gen


class Turn:
    """One response being produced: its ids, its text so far, and what is stored."""

    def __init__(self, req: ResponsesRequest, model: str, messages: list[dict],
                 store: ResponseStore) -> None:
        self.req, self.model, self.messages, self.store = req, model, messages, store
        self.response_id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.parts: list[str] = []
        self.logprobs: list[dict] = []
        self.finish_reason: str | None = None

    def add(self, delta: ChoiceDelta) -> list[dict]:
        """Take a delta in; its logprobs in the Responses shape."""
        self.parts.append(delta.text)
        logprobs = self._logprobs(delta)
        self.logprobs += logprobs
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
        return logprobs

    def _logprobs(self, delta: ChoiceDelta) -> list[dict]:
        if not self.req.wants_logprobs or not delta.logprobs:
            return []
        return chat_logprobs(delta.logprobs, self.req.top_logprobs or 0)["content"]

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def response(self, status: str, gen: Generation | None = None) -> dict:
        if status == "in_progress":
            return response_object(self.req, self.response_id, self.model, self.created_at,
                                   status, [])
        incomplete = self.finish_reason == "length"
        status = "incomplete" if incomplete else "completed"
        item = output_message(self.message_id, self.text, status, self.logprobs)
        usage = usage_object(gen.usage.prompt_tokens, gen.usage.completion_tokens,
                             gen.usage.cached_tokens)
        return response_object(self.req, self.response_id, self.model, self.created_at,
                               status, [item], usage,
                               "max_output_tokens" if incomplete else None)

    def finish(self, gen: Generation) -> dict:
        """The final response object, stored when the request asked for it."""
        response = self.response("completed", gen)
        if self.req.store:
            self.store.put(self.response_id, StoredResponse(
                response, self.messages + [{"role": "assistant", "content": self.text}]))
        return response

    async def events(self, gen: Generation, first: ChoiceDelta,
                     deltas: AsyncIterator[ChoiceDelta]) -> AsyncIterator[bytes]:
        seq = itertools.count()

        def event(kind: str, **payload) -> bytes:
            payload = {"type": kind, **payload, "sequence_number": next(seq)}
            return (f"event: {kind}\ndata: ".encode()
                    + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")

        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        yield event("response.created", response=self.response("in_progress"))
        yield event("response.in_progress", response=self.response("in_progress"))
        yield event("response.output_item.added", output_index=0,
                    item=output_message(self.message_id, "", "in_progress"))
        yield event("response.content_part.added", part=output_text_part(""), **where)
        try:
            delta = first
            while True:
                logprobs = self.add(delta)
                if delta.text:
                    yield event("response.output_text.delta", delta=delta.text,
                                logprobs=logprobs, **where)
                delta = await anext(deltas, None)
                if delta is None:
                    break
        except APIError as exc:
            yield event("error", code=str(exc.status), message=exc.message, param=exc.param)
            return
        except Exception as exc:  # noqa: BLE001 (the client gets an error event, never a hang)
            logger.exception("response stream failed")
            yield event("error", code="500", message=f"internal error: {exc}", param=None)
            return
        finally:
            await deltas.aclose()
        final = self.finish(gen)
        item = final["output"][0]
        yield event("response.output_text.done", text=self.text, logprobs=self.logprobs, **where)
        yield event("response.content_part.done", part=item["content"][0], **where)
        yield event("response.output_item.done", output_index=0, item=item)
        yield event("response.completed", response=final)
