"""OpenAI response bodies and SSE framing, built as plain dicts (cheap per chunk).

Non-streamed bodies are assembled here from each choice's accumulated deltas
(`ChoiceText`); streamed chunks are in `completion_chunks.py`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from json import encoder as _json_encoder

from pagoda.services.gateway.generation.choices import ChoiceDelta
from pagoda.services.gateway.openai.chat_output import ChatOutput
from pagoda.services.gateway.openai.logprobs import (TokenLogprob, chat_logprobs,
                                                     completion_logprobs, prompt_logprobs_json)

DONE = b"data: [DONE]\n\n"


def _not_serializable(o):
    raise TypeError(f"Object of type {o.__class__.__name__} is not JSON serializable")


def _c_encoder():
    """The C encoder `json.dumps(obj, separators=(",", ":"))` builds on every call,
    built once (its construction is half the cost of a small chunk's dumps). None
    when this Python has no C encoder or it does not agree with json.dumps on a probe:
    then compact_json is json.dumps itself."""
    make = _json_encoder.c_make_encoder
    if make is None:
        return None
    try:
        enc = make(None, _not_serializable, _json_encoder.encode_basestring_ascii, None, ":",
                   ",", False, False, True)
        probe = {"a": [1, 2.5, None, True, "\u00e9\ud83d\ude00\n"], "b": {"c": -0.0}}
        if "".join(enc(probe, 0)) != json.dumps(probe, separators=(",", ":")):
            return None
    except Exception:  # noqa: BLE001 - another Python's signature: the plain path
        return None
    return enc


_ENCODE = _c_encoder()


def compact_json(payload) -> str:
    """`json.dumps(payload, separators=(",", ":"))`, the same characters, cheaper."""
    if _ENCODE is None:
        return json.dumps(payload, separators=(",", ":"))
    return "".join(_ENCODE(payload, 0))


def sse(payload: dict) -> bytes:
    return b"data: " + compact_json(payload).encode() + b"\n\n"


@dataclass
class Usage:
    """Token counts of one HTTP request (all its choices). `prompt_tokens_details`
    (cached tokens) is reported only with --enable-prompt-tokens-details, as in vLLM."""

    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    report_details: bool = False

    def as_dict(self) -> dict:
        usage = {"prompt_tokens": self.prompt_tokens,
                 "completion_tokens": self.completion_tokens,
                 "total_tokens": self.prompt_tokens + self.completion_tokens}
        if self.report_details:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage


@dataclass
class ResponseHeader:
    """What every chunk of one response repeats."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class LogprobsFormat:
    """How a request wants logprobs shown: `num_top` alternatives per token (None:
    no logprobs), and tokens as `token_id:N` instead of text."""

    num_top: int | None = None
    as_token_ids: bool = False


@dataclass
class ChoiceText:
    """A non-streamed choice, accumulated."""

    parts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None

    def add(self, d: ChoiceDelta) -> None:
        self.parts.append(d.text)
        if d.logprobs:
            self.logprobs.extend(d.logprobs)
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        if d.finish_reason is not None:
            self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason

    @property
    def text(self) -> str:
        return "".join(self.parts)


def _prompt_logprobs(c: ChoiceText) -> list | None:
    return prompt_logprobs_json(c.prompt_logprobs) if c.prompt_logprobs is not None else None


def completion_choice(index: int, c: ChoiceText, fmt: LogprobsFormat,
                      echo: str | None) -> dict:
    """One completions choice; `echo` is the prompt's text when the request echoes
    (its tokens, with their logprobs, then lead the choice's logprobs)."""
    logprobs = None
    if fmt.num_top is not None:
        tokens = [*(c.prompt_logprobs or []), *c.logprobs] if echo is not None else c.logprobs
        logprobs = completion_logprobs(tokens, fmt.num_top, 0, fmt.as_token_ids)
    return {"index": index, "text": (echo or "") + c.text, "logprobs": logprobs,
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
            "prompt_logprobs": _prompt_logprobs(c)}


def completion_body(head: ResponseHeader, choices: list[ChoiceText], usage: Usage,
                    fmt: LogprobsFormat, echoes: list[str] | None = None) -> dict:
    return {"id": head.id, "object": "text_completion", "created": head.created,
            "model": head.model,
            "choices": [completion_choice(i, c, fmt, echoes[i] if echoes else None)
                        for i, c in enumerate(choices)],
            "usage": usage.as_dict()}


def chat_body(head: ResponseHeader, choices: list[ChoiceText], usage: Usage,
              fmt: LogprobsFormat, echo: str = "", output: ChatOutput | None = None) -> dict:
    """`echo`: the last message's content, when the request echoes it (vLLM's chat echo);
    `output`: the reasoning and tool-call stages each choice's text goes through."""
    out = []
    for i, c in enumerate(choices):
        logprobs = None
        if fmt.num_top is not None:
            logprobs = chat_logprobs(c.logprobs, fmt.num_top, fmt.as_token_ids)
        if output is not None and output.active:
            message, finish_reason = output.message(c.text, c.finish_reason, echo)
        else:
            message = {"role": "assistant", "content": echo + c.text}
            finish_reason = c.finish_reason
        out.append({"index": i, "message": message, "logprobs": logprobs,
                    "finish_reason": finish_reason, "stop_reason": c.stop_reason})
    return {"id": head.id, "object": "chat.completion", "created": head.created,
            "model": head.model, "choices": out, "usage": usage.as_dict(),
            "prompt_logprobs": _prompt_logprobs(choices[0]) if choices else None}
