"""OpenAI response bodies and SSE framing, built as plain dicts (cheap per chunk)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from pagoda.services.gateway.choices import ChoiceDelta

DONE = b"data: [DONE]\n\n"


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


@dataclass
class Usage:
    """Token counts of one HTTP request (all its choices)."""

    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0

    def as_dict(self) -> dict:
        usage = {"prompt_tokens": self.prompt_tokens,
                 "completion_tokens": self.completion_tokens,
                 "total_tokens": self.prompt_tokens + self.completion_tokens}
        if self.cached_tokens:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage


@dataclass
class ResponseHeader:
    """What every chunk of one response repeats."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))


def completion_chunk(head: ResponseHeader, d: ChoiceDelta) -> dict:
    return {"id": head.id, "object": "text_completion", "created": head.created,
            "model": head.model,
            "choices": [{"index": d.index, "text": d.text, "logprobs": None,
                         "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}]}


def chat_chunk(head: ResponseHeader, index: int, delta: dict, finish_reason: str | None = None,
               stop_reason: int | str | None = None) -> dict:
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    return {"id": head.id, "object": "chat.completion.chunk", "created": head.created,
            "model": head.model, "choices": [choice]}


def usage_chunk(head: ResponseHeader, obj: str, usage: Usage) -> dict:
    return {"id": head.id, "object": obj, "created": head.created, "model": head.model,
            "choices": [], "usage": usage.as_dict()}


@dataclass
class ChoiceText:
    """A non-streamed choice, accumulated."""

    parts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, d: ChoiceDelta) -> None:
        self.parts.append(d.text)
        if d.finish_reason is not None:
            self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason

    @property
    def text(self) -> str:
        return "".join(self.parts)


def completion_body(head: ResponseHeader, choices: list[ChoiceText], usage: Usage,
                    prefixes: list[str] | None = None) -> dict:
    return {"id": head.id, "object": "text_completion", "created": head.created,
            "model": head.model,
            "choices": [{"index": i, "text": (prefixes[i] if prefixes else "") + c.text,
                         "logprobs": None, "finish_reason": c.finish_reason,
                         "stop_reason": c.stop_reason} for i, c in enumerate(choices)],
            "usage": usage.as_dict()}


def chat_body(head: ResponseHeader, choices: list[ChoiceText], usage: Usage) -> dict:
    return {"id": head.id, "object": "chat.completion", "created": head.created,
            "model": head.model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": c.text},
                         "logprobs": None, "finish_reason": c.finish_reason,
                         "stop_reason": c.stop_reason} for i, c in enumerate(choices)],
            "usage": usage.as_dict()}
