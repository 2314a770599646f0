"""POST /v1/completions and /v1/chat/completions, streamed (SSE) and not."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagoda.reasoning import get_reasoning_parser
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as tpb
from pagoda.services.common.protocol.tokenizer import chat_input_to_proto
from pagoda.services.gateway.errors import APIError, from_grpc_error, internal_error_message
from pagoda.services.gateway.generation.beam_search import BeamGeneration
from pagoda.services.gateway.generation.fan_out import Generation, Prompt, new_request_id
from pagoda.services.gateway.openai.chat_output import ChatOutput
from pagoda.services.gateway.openai.completion_bodies import (DONE, ChoiceText, LogprobsFormat,
                                                              ResponseHeader, chat_body,
                                                              completion_body, sse)
from pagoda.services.gateway.openai.completion_chunks import (ChatChunks, ChunkRenderer,
                                                              CompletionChunks)
from pagoda.services.gateway.openai.request_fields import apply_prompt_fields
from pagoda.services.gateway.openai.request_models import (ChatCompletionRequest, CompletionRequest,
                                                           SamplingFields)
from pagoda.services.gateway.openai.tools import plan_tools
from pagoda.services.gateway.state import GatewayState
from pagoda.tokenizer.chat import normalize_messages
from pagoda.services.gateway.multimodal.chat_media import received_features, split_media
from pagoda.services.gateway.web.direct_body import DirectStreamingResponse

logger = logging.getLogger(__name__)
router = APIRouter()
# How often a non-streamed request checks that its client is still there.
DISCONNECT_POLL_S = 0.5


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request):
    state: GatewayState = request.app.state.gateway
    model = state.check_model(body.model)
    lora = state.lora_request(model)
    body.check_common(state.options.max_logprobs)
    num_prompts = count_prompts(body.prompt)
    state.options.limits.check_prompts(num_prompts)
    state.options.limits.check_sampling(body, num_prompts)
    prompts = await tokenize_prompts(state, body.prompt, body.cache_salt,
                                     body.add_special_tokens, lora.cache_key if lora else "")
    await apply_prompt_fields(state, body, prompts, tokenize)  # truncation, bad words
    if body.echo:
        await fill_prompt_texts(state, prompts, body.skip_special_tokens)
    rid, unique = _request_id(request, "cmpl")
    max_tokens = state.fill_defaults(body, body.max_tokens, prompts)  # --generation-config
    gen = _generation(body)(state.peers, rid, prompts, body, max_tokens, "prompt", unique,
                     echo_only=body.echo and body.max_tokens == 0, lora_request=lora)
    state.options.on_generation(gen)  # usage details, request log
    head = ResponseHeader(gen.request_id, model)
    fmt = LogprobsFormat(body.num_logprobs(), body.return_tokens_as_token_ids)
    echoes = [p.text or "" for p in prompts] if body.echo else None
    if body.stream:
        return await stream_response(gen, CompletionChunks(*_renderer_args(head, fmt, gen, body),
                                                           echoes=echoes), body, request)
    choices = await collect(gen, request)
    per_choice = [echoes[i // body.n] for i in range(len(choices))] if echoes else None
    return JSONResponse(completion_body(head, choices, gen.usage, fmt, per_choice))


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    run = await start_chat(request.app.state.gateway, body, request)
    gen, output = run.gen, run.output
    head = ResponseHeader(gen.request_id, run.model)
    fmt = LogprobsFormat(body.num_logprobs(), body.return_tokens_as_token_ids)
    echo = _chat_echo(run.messages) if body.echo else ""
    if body.stream:
        return await stream_response(gen, ChatChunks(*_renderer_args(head, fmt, gen, body),
                                                     echo=echo, output=output), body, request)
    choices = await collect(gen, request)
    return JSONResponse(chat_body(head, choices, gen.usage, fmt, echo, output))


@dataclass
class ChatRun:
    """A chat request accepted and ready to run: its generation (nothing submitted
    until its deltas are read), its output stages, the model name to report and
    the normalized messages."""

    gen: Generation
    output: ChatOutput
    model: str
    messages: list[dict]


async def start_chat(state: GatewayState, body: ChatCompletionRequest, request: Request,
                     id_prefix: str = "chatcmpl", clamp_max_tokens: bool = False) -> ChatRun:
    """Everything the chat route does before generating: every check (a 400/404 as
    APIError), the tokenization and the Generation. Other chat-shaped APIs (the
    Anthropic Messages and OpenAI Responses APIs) convert their body to a
    ChatCompletionRequest and call this, so they validate, sample and route exactly as
    chat completions do. `clamp_max_tokens`: a max token count over the room the prompt
    leaves is lowered to it (the Responses API's max_output_tokens, as vLLM does)
    instead of refused."""
    model = state.check_model(body.model)
    lora = state.lora_request(model)
    body.check_common(state.options.max_logprobs)
    state.options.limits.check_sampling(body, 1)
    check_chat_request(state, body)
    output = chat_output(state, body)
    messages, chat = chat_input(body.messages, body.add_generation_prompt,
                                body.continue_final_message, body.template_kwargs(),
                                body.tools, body.documents, state.options.limit_mm_per_prompt,
                                body.mm_processor_kwargs)
    try:
        reply = await tokenize(state, tpb.TokenizeRequest(
            chat=chat, block_size=state.peers.routing_block_size(),
            cache_salt=body.cache_salt or "", add_special_tokens=body.add_special_tokens,
            lora_key=lora.cache_key if lora else ""))
    except APIError as exc:  # a media item's refusal (loading, processor) names messages
        if chat.media and exc.status == 400 and exc.param is None:
            exc.param = "messages"
        raise
    if reply.chat_stop_token_ids:  # the chat format's own (gpt-oss: <|return|>, <|call|>)
        body.stop_token_ids = list(dict.fromkeys([*(body.stop_token_ids or []),
                                                  *reply.chat_stop_token_ids]))
    rid, unique = _request_id(request, id_prefix)
    prompt = Prompt(list(reply.token_ids), reply.prompt, _hashes(reply),
                    received_features(reply))
    output.prompt = reply.prompt  # where the template left the thinking block
    await apply_prompt_fields(state, body, [prompt], tokenize)  # truncation, bad words
    requested = body.requested_max_tokens()
    if clamp_max_tokens and requested is not None:
        room = state.peers.model_info().max_model_len - len(prompt.token_ids)
        requested = min(requested, room) if room > 0 else requested
    max_tokens = state.fill_defaults(body, requested, [prompt])
    gen = _generation(body)(state.peers, rid, [prompt], body, max_tokens, "messages", unique,
                     lora_request=lora)
    state.options.on_generation(gen)
    return ChatRun(gen, output, model, messages)


def _generation(body: SamplingFields) -> type[Generation] | type[BeamGeneration]:
    """Sampled choices, or vLLM's beam search (generation/beam_search.py)."""
    return BeamGeneration if body.use_beam_search else Generation


def chat_output(state: GatewayState, body: ChatCompletionRequest) -> ChatOutput:
    """The reasoning and tool-call stages of the answer (tools.py checks the tools and
    tool_choice: a 400 for anything malformed). A tool format made of special tokens
    needs them in the text (vLLM's adjust_request)."""
    plan = plan_tools(body, state.options.auto_tool_parser)
    if plan.mode == "auto" and plan.parser.keeps_special_tokens:
        body.skip_special_tokens = False
    reasoning = state.options.reasoning_parser
    parser = get_reasoning_parser(reasoning) if reasoning else None
    if parser is not None and parser.keeps_special_tokens:
        body.skip_special_tokens = False
    return ChatOutput(parser, plan.parser, body.include_reasoning)


def _request_id(request: Request, prefix: str) -> tuple[str, bool]:
    """(response id, whether it is unique): built from the X-Request-Id middleware's id;
    a client's own id may repeat, so the scheduler's ids then get a random suffix."""
    base = getattr(request.state, "request_id", None)
    from_client = bool(getattr(request.state, "request_id_from_client", False))
    return new_request_id(prefix, base), not from_client


def _renderer_args(head: ResponseHeader, fmt: LogprobsFormat, gen: Generation,
                   body: SamplingFields) -> tuple:
    continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)
    return head, fmt, [len(p.token_ids) for p in gen.prompts], gen.n, continuous


def chat_input(messages: list[dict], add_generation_prompt: bool, continue_final_message: bool,
               chat_template_kwargs: dict | None = None, tools: list[dict] | None = None,
               documents: list[dict] | None = None,
               limit_mm_per_prompt: dict[str, int] | None = None,
               mm_processor_kwargs: dict | None = None) -> tuple[list[dict], tpb.ChatInput]:
    """(the normalized messages, the tokenizer's typed chat input); a 400 naming the
    field (messages, tools, chat_template_kwargs) for invalid input. Tool-call
    arguments travel as the client's JSON string: the tokenizer parses them once, where
    the template reads them (its verdict on invalid JSON is the request's 400). Image
    parts become placeholders and MediaInputs (multimodal/chat_media.py)."""
    try:
        with_media, media = split_media(messages, limit_mm_per_prompt)
        messages = normalize_messages(with_media.messages, parse_arguments=False)
        return messages, chat_input_to_proto(messages, add_generation_prompt,
                                             continue_final_message, chat_template_kwargs, tools,
                                             documents, media, mm_processor_kwargs)
    except ValueError as exc:
        param = re.match(r"\w+", str(exc))
        raise APIError(str(exc), param=param.group(0) if param else "messages") from None


def count_prompts(prompt) -> int:
    """Prompts in a completions `prompt`: a string or a list of token ids is one."""
    if isinstance(prompt, str) or not prompt or all(isinstance(p, int) for p in prompt):
        return 1
    return len(prompt)


UNTRUSTED_TEMPLATE = ("Chat template is passed with request, but --trust-request-chat-template "
                      "is not set. Refused request with untrusted chat template.")


def check_chat_request(state: GatewayState, body) -> None:
    """What a chat body (completions or /tokenize) may bring: its own chat template only
    when the operator trusts request templates (vLLM's --trust-request-chat-template;
    it then travels in chat_template_kwargs), and messages and free-form fields within
    the limits (limits/request_limits.py). Raises APIError (400). Then lays the
    request's chat_template_kwargs over --default-chat-template-kwargs."""
    kwargs = dict(body.chat_template_kwargs or {})
    template = getattr(body, "chat_template", None)
    if template is not None or "chat_template" in kwargs:
        if not state.options.trust_request_chat_template:
            raise APIError(UNTRUSTED_TEMPLATE, param="chat_template")
        if template is not None:
            body.chat_template_kwargs = {**kwargs, "chat_template": template}
    state.options.limits.check_messages(body.messages, chat_template_kwargs=kwargs,
                                        tools=getattr(body, "tools", None))
    defaults = state.options.default_chat_template_kwargs
    if defaults:  # the operator's (--default-chat-template-kwargs), under the request's
        body.chat_template_kwargs = {**defaults, **(body.chat_template_kwargs or {})}


def _hashes(reply: tpb.TokenizeResponse) -> list[bytes] | None:
    """The prompt's block hashes, if the tokenization was asked for them."""
    return list(reply.block_hashes) if reply.block_hashes else None


def _chat_echo(messages: list[dict]) -> str:
    """vLLM's chat echo: the last message's content when it is the assistant's own."""
    last = messages[-1]
    return (last.get("content") or "") if last.get("role") == "assistant" else ""


async def tokenize(state: GatewayState, request: tpb.TokenizeRequest) -> tpb.TokenizeResponse:
    state.peers.tokenizer_info()  # 503 until the tokenizer serves
    try:
        return await state.peers.tokenizer.stub.Tokenize(request, timeout=60.0)
    except grpc.RpcError as exc:
        raise from_grpc_error(exc, "tokenizer") from None


async def tokenize_prompts(state: GatewayState, prompt, cache_salt: str | None = None,
                           add_special_tokens: bool = True, lora_key: str = ""
                           ) -> list[Prompt]:
    """A string, a list of strings, token ids, or a list of token-id lists. The first
    prompt (the one routing looks at) comes back with its block hashes (keyed by the
    salt and the LoRA adapter's `lora_key`) when routing wants them and it was text;
    a prompt given as ids is not sent anywhere here."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError("The prompt cannot be empty.", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [Prompt(list(prompt))]

    async def one(p, block_size: int) -> Prompt:
        if not isinstance(p, str):
            return Prompt(list(p))
        reply = await tokenize(state, tpb.TokenizeRequest(
            prompt=p, add_special_tokens=add_special_tokens, block_size=block_size,
            cache_salt=cache_salt or "", lora_key=lora_key))
        return Prompt(list(reply.token_ids), p, _hashes(reply))

    block_size = state.peers.routing_block_size()
    if len(prompt) == 1:  # the common case: no task and gather per request
        return [await one(prompt[0], block_size)]
    return list(await asyncio.gather(*(one(p, block_size if i == 0 else 0)
                                       for i, p in enumerate(prompt))))


async def fill_prompt_texts(state: GatewayState, prompts: list[Prompt],
                            skip_special_tokens: bool) -> None:
    """Give prompts sent as token ids their text (what `echo` shows)."""
    vocab = state.peers.tokenizer_info().vocab_size
    for p in prompts:
        if p.text is not None or not p.token_ids or not all(0 <= t < vocab for t in p.token_ids):
            continue  # an invalid prompt is rejected by Generation with a clearer message
        try:
            reply = await state.peers.tokenizer.stub.Detokenize(
                tpb.DetokenizeRequest(token_ids=p.token_ids,
                                      skip_special_tokens=skip_special_tokens), timeout=60.0)
        except grpc.RpcError as exc:
            raise from_grpc_error(exc, "tokenizer") from None
        p.text = reply.text


async def collect(gen: Generation, request: Request) -> list[ChoiceText]:
    """Run a non-streamed request to the end (or until its client leaves)."""

    async def run() -> list[ChoiceText]:
        choices = [ChoiceText() for _ in range(gen.num_choices)]
        async for delta in gen.deltas():
            choices[delta.index].add(delta)
        return choices

    return await until_disconnected(run(), request)


async def until_disconnected(awaitable, request: Request):
    """Await `awaitable`, or cancel it if the client goes away (cancelling closes the
    scheduler streams, which aborts the requests and frees their KV blocks)."""
    task = asyncio.ensure_future(awaitable)
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


async def stream_response(gen: Generation, renderer: ChunkRenderer, body: SamplingFields,
                          request: Request) -> StreamingResponse:
    """SSE of every delta, then usage (if asked) and `data: [DONE]`.

    The first delta is awaited before the response starts, so errors found on
    submission (bad input, no replica, a full queue) are a plain HTTP error, not an
    SSE event. A later failure is an error event, then `data: [DONE]`. A client
    that leaves aborts the request: while it waits for the first token (here) or
    mid-stream (Starlette cancels `events`).
    """
    deltas = gen.deltas()
    first = await until_disconnected(anext(deltas), request)
    include_usage = bool(body.stream_options and body.stream_options.include_usage
                         or request.app.state.gateway.options.enable_force_include_usage)

    async def events() -> AsyncIterator[bytes]:
        # One write per delta (its chunks joined: chat's role chunk and first text, a
        # last text and its finish chunk). The delta that ends the last choice is held
        # and goes out with what closes the stream (usage, [DONE]) in one write: the
        # bytes are the same, the client gets them no later (nothing is awaited after
        # the last delta but the generators' ends), and a short request saves writes.
        held, unfinished = b"", gen.num_choices

        def take(delta) -> bytes:
            """What to write now for `delta` (the rest is held)."""
            nonlocal held, unfinished
            frames = renderer.frames(delta)
            unfinished -= delta.finish_reason is not None
            if unfinished > 0:
                return frames
            held += frames
            return b""

        tail = b""
        try:
            if now := take(first):
                yield now
            async for delta in deltas:
                if now := take(delta):
                    yield now
            tail = held + (sse(renderer.usage_chunk(gen.usage)) if include_usage else b"")
        except APIError as exc:
            tail = held + sse(exc.body())
        except Exception as exc:  # noqa: BLE001 (the client gets an error event, never a hang)
            logger.exception("stream failed")
            tail = held + sse(APIError(internal_error_message(exc), 500).body())
        finally:
            await deltas.aclose()
        yield tail + DONE

    return DirectStreamingResponse(events(), media_type="text/event-stream")
