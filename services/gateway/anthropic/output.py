"""A chat answer -> Anthropic's message: content blocks, stop_reason, usage; whole or as
Anthropic's SSE events.

The answer's text goes through the chat route's own stages (openai/chat_output.py:
reasoning parser, then tool parser), whose OpenAI deltas map onto blocks:

    {"reasoning"}            -> a thinking block    (thinking_delta)
    {"content"}              -> a text block        (text_delta)
    {"tool_calls": [{id..}]} -> a tool_use block    (input_json_delta: the arguments)

A streamed message is `message_start`, then per block `content_block_start`,
`content_block_delta`..., `content_block_stop` (blocks never interleave: a new kind of
delta closes the open block), then `message_delta` (stop_reason, output tokens) and
`message_stop`. The non-streamed message is the same stages fed the whole answer, so
both hold the same blocks. An answer with no block at all holds one empty text block.

    finish_reason   stop (EOS, stop token)  stop (a stop string)   length      tool_calls
    stop_reason     end_turn                stop_sequence (+ it)   max_tokens  tool_use
"""

from __future__ import annotations

import json
import logging
from typing import Any

from pagoda.services.gateway.openai.chat_output import ChatOutput

logger = logging.getLogger(__name__)


def stop_reason(finish_reason: str | None, stop: int | str | None
                ) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished answer; `finish_reason` after the
    tool stage (tool_calls when it read calls)."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "repetition":  # its stop reason names no stop sequence
        return "end_turn", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def message_object(message_id: str, model: str, content: list[dict[str, Any]],
                   reason: tuple[str | None, str | None], input_tokens: int,
                   output_tokens: int) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason[0], "stop_sequence": reason[1],
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}}


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's JSON arguments as its `input` object ({} for arguments cut short by
    max_tokens, whose stop_reason says so)."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        logger.info("tool call arguments are not complete JSON: %.200r", arguments)
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(output: ChatOutput, text: str, finish_reason: str | None
                   ) -> tuple[list[dict[str, Any]], str | None]:
    """The blocks of a whole answer, and its finish_reason after the tool stage."""
    message, finish_reason = output.message(text, finish_reason)
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning"):
        blocks.append({"type": "thinking", "thinking": message["reasoning"], "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls", ()):
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": tool_input(call["function"]["arguments"])})
    return blocks or [{"type": "text", "text": ""}], finish_reason


def sse_event(kind: str, **payload: Any) -> bytes:
    data = json.dumps({"type": kind, **payload}, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n".encode()


class BlockEvents:
    """One streamed answer's content blocks as SSE events. Invariant: at most one block
    is open; indexes count up from 0 in the order blocks start."""

    def __init__(self, output: ChatOutput) -> None:
        self._stream = output.stream()
        self._open: str | None = None  # kind of the open block
        self._count = 0  # blocks started

    def feed(self, text: str, finish_reason: str | None) -> list[bytes]:
        """Events for a text delta; with `finish_reason`, also what the stages held back
        and the last block's stop."""
        deltas = self._stream.feed(text)
        if finish_reason is not None:
            deltas += self._stream.finish()
        events = [event for delta in deltas for event in self._delta(delta)]
        if finish_reason is not None:
            if self._count == 0:
                events += self._start({"type": "text", "text": ""})
            events += self._close()
        return events

    def finish_reason(self, finish_reason: str | None) -> str | None:
        return self._stream.finish_reason(finish_reason)

    def _delta(self, delta: dict[str, Any]) -> list[bytes]:
        if delta.get("reasoning"):
            return self._into("thinking", {"type": "thinking", "thinking": "", "signature": ""},
                              {"type": "thinking_delta", "thinking": delta["reasoning"]})
        if delta.get("content"):
            return self._into("text", {"type": "text", "text": ""},
                              {"type": "text_delta", "text": delta["content"]})
        events = []
        for item in delta.get("tool_calls", ()):
            function = item.get("function", {})
            if "id" in item:  # a new call: its own block
                events += self._close() + self._start({
                    "type": "tool_use", "id": item["id"], "name": function.get("name", ""),
                    "input": {}})
            if function.get("arguments"):
                events.append(self._block_delta({"type": "input_json_delta",
                                                 "partial_json": function["arguments"]}))
        return events

    def _into(self, kind: str, start: dict[str, Any], delta: dict[str, Any]) -> list[bytes]:
        events = [] if self._open == kind else self._close() + self._start(start)
        return events + [self._block_delta(delta)]

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        self._open = block["type"]
        self._count += 1
        return [sse_event("content_block_start", index=self._count - 1, content_block=block)]

    def _block_delta(self, delta: dict[str, Any]) -> bytes:
        return sse_event("content_block_delta", index=self._count - 1, delta=delta)

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = None
        return [sse_event("content_block_stop", index=self._count - 1)]
