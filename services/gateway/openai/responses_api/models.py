"""The OpenAI Responses API's request and response objects, mapped onto the chat path.

A `ResponsesRequest` becomes chat messages (`conversation`, input_items.py) and a
`ChatCompletionRequest` (`to_chat_request`), so the Responses API samples, validates,
renders its tools and routes exactly as chat completions do; only its input and output
shapes are its own. Fields OpenAI defines but Pagoda cannot honour (background mode,
prompt templates, non-function tools, non-text input) are refused with a 400 naming
them; the rest are echoed back in the response object, as OpenAI and vLLM do.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Literal, Mapping

from pydantic import Field

from pagoda.services.gateway.errors import APIError
from pagoda.services.gateway.openai.request_models import (INT32_MAX, INT64_MAX, INT64_MIN,
                                                          ChatCompletionRequest, _Body)
from pagoda.services.gateway.openai.responses_api.input_items import (chat_tool_choice,
                                                                      chat_tools, input_messages)
from pagoda.services.gateway.openai.vllm_only_fields import RESPONSES_UNSERVED

# The `include` entry that asks for the output text's logprobs.
INCLUDE_LOGPROBS = "message.output_text.logprobs"
# OpenAI's `include` values (only the logprobs change what Pagoda returns).
INCLUDABLE = frozenset({INCLUDE_LOGPROBS, "reasoning.encrypted_content",
                        "file_search_call.results", "web_search_call.results",
                        "web_search_call.action.sources", "message.input_image.image_url",
                        "computer_call_output.output.image_url",
                        "code_interpreter_call.outputs"})
REASONING_EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh"})
TEXT_FORMATS = frozenset({"text", "json_schema", "json_object"})
# OpenAI's metadata limits: 16 pairs, keys up to 64 characters, values up to 512.
MAX_METADATA, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


class ResponsesRequest(_Body):
    """POST /v1/responses (OpenAI's fields, plus vLLM's extras: top_k, priority,
    cache_salt, skip_special_tokens, and the sampling fields that chat shares)."""

    vllm_unserved: ClassVar[Mapping[str, str]] = RESPONSES_UNSERVED

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Annotated[int, Field(le=INT32_MAX)] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    truncation: Literal["auto", "disabled"] | None = "disabled"
    include: list[str] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None
    background: bool = False
    prompt: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: str | None = "auto"
    priority: Annotated[int, Field(ge=-INT32_MAX - 1, le=INT32_MAX)] = 0
    cache_salt: str | None = None
    skip_special_tokens: bool = True
    # OpenAI's: at most this many calls of the gateway's own (--tool-server) tools.
    max_tool_calls: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None
    # vLLM's ResponsesRequest extras, served by the chat path as chat serves them.
    logit_bias: dict[str, float] | None = None
    seed: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    stop: str | list[str] | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    structured_outputs: dict[str, Any] | None = None
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None

    def check(self) -> None:
        """What Pagoda's Responses API does not serve, and malformed fields the chat
        path does not see: a 400 naming the field."""
        if self.background:
            raise APIError("background mode is not supported.", param="background")
        if self.prompt is not None:
            raise APIError("prompt template is not supported", param="prompt")
        previous = self.previous_response_id
        if previous is not None and (not previous.startswith("resp") or len(previous) > 256):
            raise APIError(f"Invalid 'previous_response_id': '{previous[:256]}'. Expected an "
                           f"ID that begins with 'resp' (at most 256 characters).",
                           param="previous_response_id")
        for value in self.include or ():
            if value not in INCLUDABLE:
                raise APIError(f"include: {value!r} is not one of "
                               f"{', '.join(sorted(INCLUDABLE))}.", param="include")
        if len(self.include or ()) > len(INCLUDABLE):
            raise APIError("include lists a value more than once.", param="include")
        self._check_metadata()
        self._check_reasoning()
        kind = ((self.text or {}).get("format") or {"type": "text"}).get("type")
        if kind not in TEXT_FORMATS:
            raise APIError(f"text.format.type must be one of {', '.join(sorted(TEXT_FORMATS))}"
                           f", got {kind!r}.", param="text")

    def _check_metadata(self) -> None:
        metadata = self.metadata or {}
        if len(metadata) > MAX_METADATA:
            raise APIError(f"metadata has {len(metadata)} keys; at most {MAX_METADATA}.",
                           param="metadata")
        for key, value in metadata.items():
            if len(key) > MAX_METADATA_KEY or not isinstance(value, str) or \
                    len(value) > MAX_METADATA_VALUE:
                raise APIError(f"metadata[{key[:MAX_METADATA_KEY]!r}]: keys are strings of up "
                               f"to {MAX_METADATA_KEY} characters and values strings of up "
                               f"to {MAX_METADATA_VALUE}.", param="metadata")

    def _check_reasoning(self) -> None:
        reasoning = self.reasoning or {}
        unknown = set(reasoning) - {"effort", "summary", "generate_summary"}
        if unknown:
            raise APIError(f"reasoning: unknown field(s) {', '.join(sorted(unknown))}.",
                           param="reasoning")
        effort = reasoning.get("effort")
        if effort is not None and effort not in REASONING_EFFORTS:
            raise APIError(f"reasoning.effort must be one of "
                           f"{', '.join(sorted(REASONING_EFFORTS))}, got {effort!r}.",
                           param="reasoning")

    @property
    def wants_logprobs(self) -> bool:
        return INCLUDE_LOGPROBS in (self.include or ())


def conversation(req: ResponsesRequest, history: list[dict[str, Any]]
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the chat the model answers, the conversation a follow-up continues): the
    instructions (as a system message) lead the first only, since a follow-up does not
    inherit them (OpenAI's rule); then the stored conversation of
    `previous_response_id`, then this request's input."""
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    turn = history + input_messages(req.input, history)
    return system + turn, turn


def to_chat_request(req: ResponsesRequest, messages: list[dict[str, Any]],
                    extra_tools: list[dict[str, Any]] | None = None,
                    max_model_len: int | None = None) -> ChatCompletionRequest:
    """The chat completion that answers `req` (n = 1; its own validation applies):
    its function tools, and `extra_tools` (chat tools of the gateway's --tool-server
    that the gateway runs itself; tool_choice auto unless the client chose).
    `max_model_len`: the served context, which truncation "auto" fits the prompt to."""
    logprobs = req.wants_logprobs
    effort = (req.reasoning or {}).get("effort")
    function_tools = (chat_tools(req.tools) or []) + (extra_tools or []) or None
    return ChatCompletionRequest(
        model=req.model, messages=messages, max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, stream=req.stream,
        user=req.user, cache_salt=req.cache_salt, priority=req.priority,
        skip_special_tokens=req.skip_special_tokens, logprobs=logprobs,
        logit_bias=req.logit_bias, seed=req.seed, stop=req.stop,
        repetition_penalty=req.repetition_penalty, ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output,
        structured_outputs=req.structured_outputs, vllm_xargs=req.vllm_xargs,
        truncate_prompt_tokens=auto_truncation(req, max_model_len),
        top_logprobs=(req.top_logprobs or 0) if logprobs else None,
        response_format=response_format(req.text), tools=function_tools,
        tool_choice=chat_tool_choice(req.tool_choice, "tool_choice" in req.model_fields_set)
        or ("auto" if extra_tools else None),
        parallel_tool_calls=req.parallel_tool_calls,
        # gpt-oss style templates read the effort (vLLM passes it the same way).
        chat_template_kwargs={"reasoning_effort": effort} if effort else None)


def auto_truncation(req: ResponsesRequest, max_model_len: int | None) -> int | None:
    """vLLM's reading of truncation "auto": the prompt keeps its last tokens, as many as
    leave room for max_output_tokens (vLLM's max_input_tokens; -1, the whole context,
    without a max_output_tokens or a known context); "disabled": None, no truncation."""
    if req.truncation != "auto":
        return None
    if max_model_len is None or req.max_output_tokens is None:
        return -1
    return max(max_model_len - req.max_output_tokens, 1)


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` in chat's `response_format` shape (json_schema nests its schema)."""
    fmt = (text or {}).get("format") or {"type": "text"}
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    return {"type": kind}


def response_object(req: ResponsesRequest, response_id: str, model: str, created_at: int,
                    status: str, output: list[dict[str, Any]], usage: dict | None = None,
                    incomplete_reason: str | None = None) -> dict[str, Any]:
    """OpenAI's `response` object; the request's settings are echoed back."""
    return {
        "id": response_id, "object": "response", "created_at": created_at,
        "completed_at": int(time.time()) if status == "completed" else None,
        "status": status, "model": model, "output": output, "usage": usage,
        "error": None,
        "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "top_logprobs": req.top_logprobs,
        "previous_response_id": req.previous_response_id, "store": req.store,
        "metadata": req.metadata, "user": req.user, "background": False,
        "parallel_tool_calls": req.parallel_tool_calls, "tool_choice": req.tool_choice,
        "tools": req.tools, "truncation": req.truncation, "reasoning": req.reasoning,
        "service_tier": req.service_tier, "text": req.text or {"format": {"type": "text"}},
    }


def usage_object(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
                 reasoning_tokens: int = 0) -> dict:
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + completion_tokens}
