"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API on the
chat path.

A request becomes chat messages (instructions, the stored conversation of
`previous_response_id`, the input items), tools and a chat completion (models.py,
input_items.py), which `start_chat` checks, renders with the chat template, tokenizes
and routes exactly as /v1/chat/completions does. The model's answer goes through the
chat path's output stages (--reasoning-parser, the tool plan's parser) and becomes
output items: reasoning, message, function_call (output_items.py). Streamed, it is
OpenAI's event sequence:

    response.created, response.in_progress,
    per item: response.output_item.added, [response.content_part.added],
              deltas (response.reasoning_text.delta | response.output_text.delta |
                      response.function_call_arguments.delta),
              the matching .done events, [response.content_part.done],
              response.output_item.done
    response.completed (also when the answer hit max_output_tokens: status incomplete)

each an SSE `event:` line with its JSON `data:` (carrying `sequence_number`, 0, 1,
...). Errors found before generation starts are a plain HTTP error; a failure later
is an `error` event that ends the stream. With `store` (the default) the finished
response and its conversation go to the store (store.py: the cluster's Redis when the
gateway has a kv-cache-manager, so every replica reads it), where
`previous_response_id`, GET and DELETE find them.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from pagoda.services.gateway.errors import APIError, internal_error_message
from pagoda.services.gateway.generation.choices import ChoiceDelta
from pagoda.services.gateway.openai import routes as openai_routes
from pagoda.services.gateway.openai.logprobs import chat_logprobs
from pagoda.services.gateway.openai.responses_api.mcp_turn import mcp_entries, respond_with_tools
from pagoda.services.gateway.openai.responses_api.models import (ResponsesRequest, conversation,
                                                                 response_object,
                                                                 to_chat_request, usage_object)
from pagoda.services.gateway.openai.responses_api.output_items import OutputBuilder, new_id
from pagoda.services.gateway.openai.responses_api.shared_store import FileResponseStore
from pagoda.services.gateway.openai.responses_api.store import (DEFAULT_MAX_BYTES,
                                                                DEFAULT_MAX_STORED_RESPONSES,
                                                                DEFAULT_TTL_S,
                                                                MemoryResponseStore,
                                                                SharedResponseStore,
                                                                StoredResponse)
from pagoda.services.gateway.openai.responses_api.tool_server import MCPToolServer
from pagoda.services.gateway.shared_state import shared_path
from pagoda.services.gateway.state import GatewayState
from pagoda.services.gateway.web.direct_body import DirectStreamingResponse

logger = logging.getLogger(__name__)
router = APIRouter()


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    state: GatewayState = request.app.state.gateway
    model = state.check_model(body.model)
    body.check()
    # The limits a chat body has, on the raw input before it is converted, and (in
    # start_chat) on the whole conversation, stored turns included.
    state.options.limits.check_messages(body.input if isinstance(body.input, list)
                                        else [body.input], "input")
    store = response_store(request.app)
    history = []
    if body.previous_response_id is not None:
        previous = await store.get(body.previous_response_id)
        if previous is None:
            raise not_found(body.previous_response_id, "previous_response_id")
        history = previous.messages
    messages, turn_messages = conversation(body, history)
    if mcp_entries(body):  # the gateway runs the tools (--tool-server)
        response, answered = await respond_with_tools(state, body, model, messages, request,
                                                      tool_server(request.app))
        if body.store:
            await store.put(response["id"], StoredResponse(
                response, turn_messages + answered[len(messages):]))
        return JSONResponse(response)
    chat = to_chat_request(body, messages, max_model_len=state.peers.model_info().max_model_len)
    run = await openai_routes.start_chat(state, chat, request,
                                         "resp", clamp_max_tokens=True)
    turn = Turn(body, run, turn_messages, store)
    if body.stream:
        deltas = run.gen.deltas()
        first = await openai_routes.until_disconnected(anext(deltas), request)
        return DirectStreamingResponse(turn.events(first, deltas),
                                       media_type="text/event-stream")

    async def run_to_end() -> None:
        async for delta in run.gen.deltas():
            turn.add(delta)

    await openai_routes.until_disconnected(run_to_end(), request)
    return JSONResponse(await turn.finish())


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request):
    item = await response_store(request.app).get(checked_id(response_id))
    if item is None:
        raise not_found(response_id)
    return JSONResponse(item.response)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request):
    if not await response_store(request.app).delete(checked_id(response_id)):
        raise not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def tool_server(app: FastAPI) -> MCPToolServer | None:
    """The app's --tool-server client (None without the flag), made on first use."""
    server = getattr(app.state, "tool_server", None)
    entries = getattr(app.state.gateway.options, "tool_server", None)
    if server is None and entries:
        server = app.state.tool_server = MCPToolServer(entries.split(","))
    return server


def checked_id(response_id: str) -> str:
    if not response_id.startswith("resp") or len(response_id) > 256:
        raise APIError(f"Invalid 'response_id': '{response_id[:256]}'. Expected an ID that "
                       f"begins with 'resp'.", param="response_id")
    return response_id


def not_found(response_id: str, param: str = "response_id") -> APIError:
    return APIError(f"Response with id '{response_id}' not found.", 404, param=param)


def response_store(app: FastAPI) -> MemoryResponseStore | SharedResponseStore:
    """The app's store, made on first use: the kv-cache-manager's (Redis, every gateway
    replica and API server reads it) when the gateway routes with one; else one SQLite
    file this gateway's API servers share (--api-server-count > 1); else in this
    process. --max-stored-responses bounds the last two (0: store nothing)."""
    store = getattr(app.state, "response_store", None)
    if store is None:
        options = app.state.gateway.options
        capacity = getattr(options, "max_stored_responses", DEFAULT_MAX_STORED_RESPONSES)
        index = getattr(getattr(app.state.gateway.peers, "router", None), "index", None)
        if index is not None:
            store = SharedResponseStore(
                index.stub, getattr(options, "responses_store_ttl", DEFAULT_TTL_S),
                getattr(options, "max_stored_response_bytes", DEFAULT_MAX_BYTES),
                enabled=capacity > 0)
        elif (path := shared_path("responses.sqlite")) and capacity > 0:
            store = FileResponseStore(path, capacity)  # this gateway's API servers share it
        else:
            store = MemoryResponseStore(capacity)
        app.state.response_store = store
    return store


class Turn:
    """One response being produced: its id, the answer's output stages and items, the
    reasoning tokens counted, and the conversation it stores."""

    def __init__(self, req: ResponsesRequest, run: openai_routes.ChatRun,
                 messages: list[dict], store) -> None:
        self.req, self.gen, self.model, self.messages, self.store = (
            req, run.gen, run.model, messages, store)
        self.stages = run.output.stream()
        self.builder = OutputBuilder()
        self.response_id = new_id("resp")
        self.created_at = int(time.time())
        self.finish_reason: str | None = None
        self.reasoning_tokens = 0
        self._ended = False

    def add(self, delta: ChoiceDelta) -> None:
        """One answer delta through the output stages into the items. A delta's tokens
        are reasoning tokens when the answer is inside the thinking block before and
        after it (the markers themselves are not counted, as in vLLM)."""
        before = self.stages.in_reasoning
        out = self.stages.feed(delta.text) if delta.text else []
        if before and self.stages.in_reasoning:
            self.reasoning_tokens += len(delta.token_ids)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
        self.builder.feed(out, self._logprobs(delta))

    def _logprobs(self, delta: ChoiceDelta) -> list[dict]:
        if not self.req.wants_logprobs or not delta.logprobs:
            return []
        return chat_logprobs(delta.logprobs, self.req.top_logprobs or 0)["content"]

    def _end(self) -> str:
        """Flush what the stages held back and close the last item; the status."""
        status = "incomplete" if self.finish_reason == "length" else "completed"
        if not self._ended:
            self._ended = True
            self.builder.feed(self.stages.finish())
            self.builder.finish(status)
        return status

    def in_progress(self) -> dict:
        return response_object(self.req, self.response_id, self.model, self.created_at,
                               "in_progress", [])

    async def finish(self) -> dict:
        """The final response object, stored when the request asked for it."""
        status = self._end()
        usage = self.gen.usage
        response = response_object(
            self.req, self.response_id, self.model, self.created_at, status,
            self.builder.items, usage_object(usage.prompt_tokens, usage.completion_tokens,
                                             usage.cached_tokens, self.reasoning_tokens),
            "max_output_tokens" if status == "incomplete" else None)
        if self.req.store:
            await self.store.put(self.response_id, StoredResponse(
                response, self.messages + [self.builder.assistant_message()]))
        return response

    async def events(self, first: ChoiceDelta, deltas: AsyncIterator[ChoiceDelta]
                     ) -> AsyncIterator[bytes]:
        seq = itertools.count()

        def event(kind: str, **payload) -> bytes:
            payload = {"type": kind, **payload, "sequence_number": next(seq)}
            return (f"event: {kind}\ndata: ".encode()
                    + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")

        yield event("response.created", response=self.in_progress())
        yield event("response.in_progress", response=self.in_progress())
        try:
            delta = first
            while delta is not None:
                self.add(delta)
                for kind, payload in self.builder.drain():
                    yield event(kind, **payload)
                delta = await anext(deltas, None)
            final = await self.finish()
        except APIError as exc:
            yield event("error", code=str(exc.status), message=exc.message, param=exc.param)
            return
        except Exception as exc:  # noqa: BLE001 (the client gets an error event, never a hang)
            logger.exception("response stream failed")
            yield event("error", code="500", message=internal_error_message(exc), param=None)
            return
        finally:
            await deltas.aclose()
        for kind, payload in self.builder.drain():
            yield event(kind, **payload)
        yield event("response.completed", response=final)
