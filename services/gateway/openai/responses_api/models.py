"""The OpenAI Responses API's request and response objects, mapped onto the chat path.

A `ResponsesRequest` becomes chat messages (`conversation`) and a
`ChatCompletionRequest` (`to_chat_request`), so the Responses API samples, validates and
routes exactly as chat completions do; only its input and output shapes are its own.
Fields OpenAI defines but Pagoda cannot honour (tools, background mode, prompt
templates, non-text input) are refused with a 400 naming them; the rest are echoed
back in the response object, as OpenAI and vLLM do.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import Field

from pagoda.services.gateway.errors import APIError
# The gateway's request-body base (extra fields ignored with a warning, no NaN).
from pagoda.services.gateway.openai.request_models import INT32_MAX, ChatCompletionRequest, _Body

# The `include` entry that asks for the output text's logprobs.
INCLUDE_LOGPROBS = "message.output_text.logprobs"
_TEXT_PARTS = {"input_text", "output_text", "text"}


class ResponsesRequest(_Body):
    """POST /v1/responses (OpenAI's fields, plus vLLM's extras: top_k, priority,
    cache_salt, skip_special_tokens)."""

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

    def check(self) -> None:
        """What Pagoda's Responses API does not serve: a 400 naming the field."""
        if self.background:
            raise APIError("background mode is not supported.", param="background")
        if self.prompt is not None:
            raise APIError("prompt template is not supported", param="prompt")
        other = [t for t in self.tools if not isinstance(t, dict) or t.get("type") != "mcp"]
        if other:
            raise APIError("tools other than type mcp (run on the gateway's --tool-server) are "
                           "not supported by the Responses API here; use chat completions "
                           "for tool calling.", param="tools")

    @property
    def wants_logprobs(self) -> bool:
        return INCLUDE_LOGPROBS in (self.include or ())


def input_messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's `input` as chat messages: a string is one user message; a list
    holds messages (`{"role", "content"}`, with or without `"type": "message"`),
    whose content is a string or text parts (input_text, output_text)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not value:
        raise APIError("input must not be empty.", param="input")
    messages = []
    for i, item in enumerate(value):
        kind = item.get("type", "message")
        if kind != "message":
            raise APIError(f"input[{i}]: items of type {kind!r} are not supported (only "
                           f"messages).", param="input")
        content = item.get("content")
        if isinstance(content, list):
            content = "\n".join(_part_text(part, f"input[{i}].content[{j}]")
                                for j, part in enumerate(content))
        messages.append({"role": item.get("role"), "content": content})
    return messages


def _part_text(part: Any, where: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
        raise APIError(f"{where}: only text parts (input_text, output_text) are supported, "
                       f"got {kind!r}.", param="input")
    return part["text"]


def conversation(req: ResponsesRequest, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat the model answers: the instructions (as a system message), the stored
    conversation of `previous_response_id`, then this request's input."""
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    return system + history + input_messages(req.input)


def to_chat_request(req: ResponsesRequest, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None) -> ChatCompletionRequest:
    """The chat completion that answers `req` (n = 1; its own validation applies);
    `tools`: chat function tools the model may call (tool_choice auto)."""
    logprobs = req.wants_logprobs
    return ChatCompletionRequest(
        model=req.model, messages=messages, max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, stream=req.stream,
        user=req.user, cache_salt=req.cache_salt, priority=req.priority,
        skip_special_tokens=req.skip_special_tokens, logprobs=logprobs,
        top_logprobs=(req.top_logprobs or 0) if logprobs else None,
        response_format=response_format(req.text), tools=tools or None,
        tool_choice="auto" if tools else None)


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


# ---------------------------------------------------------------- response objects
def output_message(message_id: str, text: str, status: str,
                   logprobs: list[dict] | None = None) -> dict[str, Any]:
    """The assistant's message item; an in-progress one has no content part yet."""
    content = [output_text_part(text, logprobs)] if status != "in_progress" else []
    return {"id": message_id, "type": "message", "status": status, "role": "assistant",
            "content": content}


def output_text_part(text: str, logprobs: list[dict] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


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


def usage_object(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens}
