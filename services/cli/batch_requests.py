"""One line of an OpenAI batch file -> engine prompts, and their outputs -> one output line.

Input line (OpenAI's batch format, as `vllm run-batch` reads it):
    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}
Output line:
    {"id": "batch_req_...", "custom_id": "r1",
     "response": {"status_code": 200, "request_id": "...", "body": {...}}, "error": null}
A line that fails (bad JSON, unknown url, a body the API would refuse, a model not
served) gets `response.status_code` 4xx, `body` null and `error` = the OpenAI error
object the server would have sent: nothing here raises for bad input.

Bodies are validated and converted by the gateway's own request models
(`openai_models`: types, ranges, `to_sampling_params`) and the same helpers
(`resolve_max_tokens`, `check_prompt`, generation-config defaults), and responses are
rendered by the gateway's `completion_body` / `chat_body`, so a batch line gets the
answer the served API gives, byte for byte in shape. `/v1/embeddings` lines go through
batch_embeddings.py and need a pooling model; chat and completions lines need a
generation model (either way, the other kind gets a 400 naming the reason).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from pagoda.outputs import PositionLogprobs, RequestOutput
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import SamplingParams
from pagoda.tokenizer.truncation import truncate_prompt
from pagoda.services.cli.batch_embeddings import embedding_body, embedding_prompts
from pagoda.services.gateway.errors import APIError, validation_message
from pagoda.services.gateway.generation.fan_out import check_prompt, resolve_max_tokens
from pagoda.services.gateway.openai.completion_bodies import (ChoiceText, LogprobsFormat,
                                                              ResponseHeader, Usage, chat_body,
                                                              completion_body)
from pagoda.services.gateway.openai.logprobs import Candidate, TokenLogprob
from pagoda.services.gateway.openai.request_models import (ChatCompletionRequest, CompletionRequest,
                                                           SamplingFields)
from pagoda.services.gateway.pooling.request_models import EmbeddingRequest
from pagoda.services.gateway.serving_options import ServingOptions
from pagoda.tokenizer import harmony
from pagoda.tokenizer.chat import normalize_messages, render_chat_template

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
EMBEDDINGS_URL = "/v1/embeddings"
ENDPOINTS = {CHAT_URL: ChatCompletionRequest, COMPLETIONS_URL: CompletionRequest,
             EMBEDDINGS_URL: EmbeddingRequest}
UNSUPPORTED_ENDPOINTS = {"/v1/score": "Pagoda serves no scoring models",
                         "/v1/rerank": "Pagoda serves no reranking models"}


@dataclass
class EngineContext:
    """What preparing a line needs from the offline engine."""

    tokenizer: Any
    served_model_names: list[str]
    model_path: str
    max_model_len: int
    options: ServingOptions
    pooling_task: str | None = None  # a pooling model's task ("embed", ...); None: generates
    harmony: bool = False  # chats in gpt-oss's harmony format (pagoda.tokenizer.harmony)

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)


@dataclass
class EnginePrompt:
    text: str | None
    token_ids: list[int]
    params: SamplingParams | PoolingParams
    priority: int = 0  # vLLM's request priority (needs --scheduling-policy priority)


@dataclass
class BatchItem:
    """One input line: either `error` is set, or `prompts` are ready for the engine."""

    line_no: int
    custom_id: str | None = None
    url: str = ""
    body: SamplingFields | EmbeddingRequest | None = None
    model: str = ""
    prompts: list[EnginePrompt] = field(default_factory=list)
    echo_only: bool = False  # completions' echo with max_tokens 0: show no output token
    error: APIError | None = None


def parse_line(line_no: int, text: str) -> BatchItem:
    """Read the envelope of one input line; `error` set for anything malformed."""
    item = BatchItem(line_no)
    try:
        request = json.loads(text)
    except json.JSONDecodeError as exc:
        item.error = APIError(f"line {line_no} is not valid JSON: {exc}")
        return item
    if not isinstance(request, dict):
        item.error = APIError(f"line {line_no} must be a JSON object")
        return item
    custom_id = request.get("custom_id")
    item.custom_id = custom_id if isinstance(custom_id, str) else None
    item.url = request.get("url") if isinstance(request.get("url"), str) else ""
    if item.custom_id is None:
        item.error = APIError("custom_id must be a string", param="custom_id")
    elif str(request.get("method", "POST")).upper() != "POST":
        item.error = APIError(f"method must be POST, got {request.get('method')!r}",
                              param="method")
    elif item.url in UNSUPPORTED_ENDPOINTS:
        item.error = APIError(f"url {item.url} is not supported by Pagoda: "
                              f"{UNSUPPORTED_ENDPOINTS[item.url]}", 404, param="url")
    elif item.url not in ENDPOINTS:
        item.error = APIError(f"url must be one of {', '.join(ENDPOINTS)}, got "
                              f"{request.get('url')!r}", 404, param="url")
    elif not isinstance(request.get("body"), dict):
        item.error = APIError("body must be a JSON object", param="body")
    else:
        try:
            item.body = ENDPOINTS[item.url].model_validate(request["body"])
        except ValidationError as exc:
            message, param = validation_message(exc.errors())
            item.error = APIError(message, param=param)
    return item


def prepare(item: BatchItem, ctx: EngineContext) -> None:
    """Validate `item.body` as the gateway does and build its engine prompts; an
    invalid body sets `item.error` instead (never raises for bad input)."""
    try:
        _prepare(item, ctx)
    except APIError as exc:
        item.error, item.prompts = exc, []
    except ValueError as exc:  # the chat template's or the engine's refusal
        item.error, item.prompts = APIError(str(exc)), []


def _prepare(item: BatchItem, ctx: EngineContext) -> None:
    body = item.body
    if body.model is not None and body.model not in ctx.served_model_names:
        raise APIError(f"The model `{body.model}` does not exist.", 404, param="model")
    item.model = body.model or ctx.served_model_names[0]
    if isinstance(body, EmbeddingRequest):
        item.prompts = [EnginePrompt(None, ids, params)
                        for ids, params in embedding_prompts(body, ctx)]
        return
    if ctx.pooling_task is not None:
        raise APIError(f"The model does not support {item.url}: it is a pooling model "
                       f"(task {ctx.pooling_task!r}); serve it without --runner pooling.")
    if body.stream:
        raise APIError("stream is not supported in a batch", param="stream")
    body.check_common(ctx.options.max_logprobs)
    stops: list[int] = []
    if isinstance(body, ChatCompletionRequest) and ctx.harmony:  # as the served route
        segments = harmony.harmony_segments(body.messages, body.tools, body.reasoning_effort,
                                            body.add_generation_prompt,
                                            body.continue_final_message)
        text = harmony.segments_text(segments)
        prompts = [(text, harmony.encode_harmony(ctx.tokenizer, segments))]
        stops = harmony.stop_token_ids(ctx.tokenizer)
        requested, param = body.requested_max_tokens(), "messages"
    elif isinstance(body, ChatCompletionRequest):
        text = render_chat_template(ctx.tokenizer, body.messages, body.add_generation_prompt,
                                    body.continue_final_message, body.chat_template_kwargs,
                                    body.tools, body.documents)
        prompts = [(text, list(ctx.tokenizer.encode(
            text, add_special_tokens=body.add_special_tokens)))]
        requested, param = body.requested_max_tokens(), "messages"
    else:
        prompts = _completion_prompts(body.prompt, ctx.tokenizer, body.add_special_tokens)
        requested, param = body.max_tokens, "prompt"
        item.echo_only = body.echo and body.max_tokens == 0
    prompts = [(text, truncate_prompt(ids, body.truncate_prompt_tokens, ctx.max_model_len))
               for text, ids in prompts]  # as the gateway does; ValueError: a 400
    requested = ctx.options.fill_defaults(body, requested, [len(ids) for _, ids in prompts],
                                          ctx.model_path, ctx.max_model_len)
    for text, ids in prompts:
        check_prompt(ids, ctx.vocab_size, param)
        limit = resolve_max_tokens(1 if item.echo_only else requested, len(ids),
                                   ctx.max_model_len, param)
        params = body.to_sampling_params(limit, ctx.vocab_size).clone(n=body.n)
        if stops:  # the chat format's own (gpt-oss: <|return|>, <|call|>; vLLM adds them)
            params = params.clone(stop_token_ids=list(dict.fromkeys(
                [*params.stop_token_ids, *stops])))
        item.prompts.append(EnginePrompt(text, ids, params, body.priority))


def _completion_prompts(prompt: Any, tokenizer: Any, add_special_tokens: bool = True
                        ) -> list[tuple[str | None, list[int]]]:
    """A string, strings, token ids or lists of token ids -> (text, ids) pairs."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError("The prompt cannot be empty.", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [(None, list(prompt))]
    return [(p, list(tokenizer.encode(p, add_special_tokens=add_special_tokens)))
            if isinstance(p, str) else (None, list(p))
            for p in prompt]


def response_body(item: BatchItem, outputs: list[RequestOutput], ctx: EngineContext) -> dict:
    """The API's response body for `item`, from its prompts' finished outputs."""
    body = item.body
    if isinstance(body, EmbeddingRequest):
        return embedding_body(body, item.model, outputs, ctx.options.enable_prompt_tokens_details)
    n = body.n
    choices: list[ChoiceText] = []
    usage = Usage(prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
                  report_details=ctx.options.enable_prompt_tokens_details)
    num_top = body.num_logprobs()
    for output in outputs:
        usage.cached_tokens += output.num_cached_tokens
        prompt_lps = (_prompt_logprobs(output, ctx.tokenizer)
                      if output.prompt_logprobs is not None else None)
        for completion in sorted(output.outputs, key=lambda c: c.index):
            shown = not item.echo_only
            usage.completion_tokens += len(completion.token_ids) if shown else 0
            choices.append(ChoiceText(
                parts=[completion.text] if shown else [],
                finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                logprobs=_logprobs(completion.logprobs, completion.token_ids, num_top)
                if shown and num_top is not None else [],
                prompt_logprobs=prompt_lps))
    head = ResponseHeader(f"{'chatcmpl' if item.url == CHAT_URL else 'cmpl'}-"
                          f"{uuid.uuid4().hex}", item.model)
    fmt = LogprobsFormat(num_top, body.return_tokens_as_token_ids)
    if item.url == CHAT_URL:
        # vLLM's chat echo: the assistant's own (content only: no arguments parsed)
        last = normalize_messages(body.messages, parse_arguments=False)[-1]
        echo = (last.get("content") or "") if body.echo and last["role"] == "assistant" else ""
        return chat_body(head, choices, usage, fmt, echo)
    echoes = None
    if body.echo:
        texts = [o.prompt if o.prompt is not None else ctx.tokenizer.decode(o.prompt_token_ids)
                 for o in outputs]
        echoes = [texts[i // n] for i in range(len(choices))]
    return completion_body(head, choices, usage, fmt, echoes)


def _logprobs(positions: list[PositionLogprobs] | None, token_ids: list[int],
              num_top: int) -> list[TokenLogprob]:
    """The offline engine's per-position dicts as the gateway's TokenLogprob rows: the
    sampled token, and the `num_top` best candidates by rank."""
    rows = []
    for token_id, position in zip(token_ids, positions or []):
        rows.append(_row(token_id, position, num_top))
    return rows


def _prompt_logprobs(output: RequestOutput, tokenizer: Any) -> list[TokenLogprob]:
    rows = []
    for token_id, position in zip(output.prompt_token_ids, output.prompt_logprobs):
        if position is None:  # the first prompt token: nothing scores it
            rows.append(TokenLogprob(token_id, tokenizer.decode([token_id])))
        else:
            rows.append(_row(token_id, position, len(position)))
    return rows


def _row(token_id: int, position: PositionLogprobs, num_top: int) -> TokenLogprob:
    chosen = position[token_id]
    ranked = sorted(position.items(), key=lambda kv: kv[1].rank or 0)
    top = [Candidate(t, lp.decoded_token or "", lp.logprob, lp.rank or 0)
           for t, lp in ranked[:num_top]]
    return TokenLogprob(token_id, chosen.decoded_token or "", chosen.logprob, chosen.rank, top)


def output_line(item: BatchItem, body: dict | None = None) -> dict:
    """The output line of `item`: its response body, or its error."""
    status = 200 if item.error is None else item.error.status
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": item.custom_id,
            "response": {"status_code": status, "request_id": f"pagoda-batch-{uuid.uuid4().hex}",
                         "body": body if item.error is None else None},
            "error": None if item.error is None else item.error.body()["error"]}
