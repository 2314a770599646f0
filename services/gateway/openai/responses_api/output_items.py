"""A response's output items, built from the chat path's answer deltas, with the events
that stream them.

The chat path's output stages (chat_output.py: --reasoning-parser, then the tool plan's
parser) turn the model's text into deltas of reasoning, content and tool calls; here
they become OpenAI's output items, in the order the model wrote them:

    reasoning      {"type": "reasoning", "summary": [], "content": [reasoning_text]}
    message        {"type": "message", "role": "assistant", "content": [output_text]}
    function_call  {"type": "function_call", "call_id", "name", "arguments"}

Each item is opened (`response.output_item.added`, plus `response.content_part.added`
for a part), grows by deltas (`response.reasoning_text.delta`,
`response.output_text.delta`, `response.function_call_arguments.delta`) and is closed
(`....done` events, then `response.output_item.done`) when the next one opens or the
answer ends. Streamed or not, a response goes through this one builder, so the items
of `create(stream=True)`'s `response.completed` equal `create()`'s.
"""

from __future__ import annotations

import uuid
from typing import Any

Event = tuple[str, dict[str, Any]]  # (type, payload without type / sequence_number)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_text_part(text: str, logprobs: list[dict] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def output_message(message_id: str, text: str, status: str) -> dict[str, Any]:
    """A whole assistant message item (the tool-server loop's final answer)."""
    return {"id": message_id, "type": "message", "status": status, "role": "assistant",
            "content": [output_text_part(text)]}


class OutputBuilder:
    """Invariant: `items` holds every item opened so far, at most the last one open
    (status "in_progress"); `events` are drained by the caller after each `feed`."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.events: list[Event] = []
        self._open: dict[str, Any] | None = None
        self._logprobs: list[dict] = []  # the open message's
        self.calls: list[dict[str, Any]] = []  # chat tool_calls of the answer, in order

    # ------------------------------------------------------------ feeding
    def feed(self, deltas: list[dict[str, Any]], logprobs: list[dict] | None = None) -> None:
        """Chat deltas (chat_output.ChoiceOutputStream's); `logprobs`: those of the
        tokens the deltas came from, given to the text they hold."""
        for delta in deltas:
            if delta.get("reasoning"):
                self._reasoning(delta["reasoning"])
            if delta.get("content"):
                self._text(delta["content"], logprobs or [])
                logprobs = None
            for call in delta.get("tool_calls") or ():
                self._call(call)

    def finish(self, status: str) -> None:
        """Close the open item; `status`: "completed" or "incomplete" (the answer hit
        max_output_tokens). An answer with no output at all is one empty message, so
        a response always has an item to read (as OpenAI's and vLLM's do)."""
        if not self.items:
            self._text("", [])
        if self._open is not None:
            self._close(status)

    def drain(self) -> list[Event]:
        events, self.events = self.events, []
        return events

    # ------------------------------------------------------------ items
    def _start(self, kind: str, item: dict[str, Any]) -> None:
        if self._open is not None:
            self._close("completed")
        self._open = {"kind": kind, "index": len(self.items), "text": ""}
        self.items.append(item)
        self._emit("response.output_item.added", output_index=self._open["index"],
                   item=dict(item))

    def _where(self, content: bool = True) -> dict[str, Any]:
        where = {"item_id": self.items[-1]["id"], "output_index": self._open["index"]}
        return {**where, "content_index": 0} if content else where

    def _reasoning(self, text: str) -> None:
        if self._kind() != "reasoning":
            self._start("reasoning", {"id": new_id("rs"), "type": "reasoning", "summary": [],
                                      "content": [], "status": "in_progress"})
            self._emit("response.content_part.added", part=_reasoning_part(""),
                       **self._where())
        self._open["text"] += text
        self._emit("response.reasoning_text.delta", delta=text, **self._where())

    def _text(self, text: str, logprobs: list[dict]) -> None:
        if self._kind() != "message":
            self._start("message", {"id": new_id("msg"), "type": "message",
                                    "status": "in_progress", "role": "assistant",
                                    "content": []})
            self._logprobs = []
            self._emit("response.content_part.added", part=output_text_part(""),
                       **self._where())
        self._open["text"] += text
        self._logprobs += logprobs
        if text:
            self._emit("response.output_text.delta", delta=text, logprobs=logprobs,
                       **self._where())

    def _call(self, call: dict[str, Any]) -> None:
        function = call.get("function") or {}
        if call.get("id"):  # a new call: its id and name come once, first
            self.calls.append({"id": call["id"], "type": "function",
                               "function": {"name": function.get("name", ""),
                                            "arguments": ""}})
            self._start("function_call", {
                "id": new_id("fc"), "type": "function_call", "call_id": call["id"],
                "name": function.get("name", ""), "arguments": "", "status": "in_progress"})
        arguments = function.get("arguments") or ""
        if arguments and self._kind() == "function_call":
            self._open["text"] += arguments
            self.calls[-1]["function"]["arguments"] += arguments
            self._emit("response.function_call_arguments.delta", delta=arguments,
                       **self._where(content=False))

    def _close(self, status: str) -> None:
        kind, text, item = self._open["kind"], self._open["text"], self.items[-1]
        where = self._where(content=kind != "function_call")
        if kind == "reasoning":
            part = _reasoning_part(text)
            self._emit("response.reasoning_text.done", text=text, **where)
            self._emit("response.content_part.done", part=part, **where)
            item["content"] = [part]
        elif kind == "message":
            part = output_text_part(text, self._logprobs)
            self._emit("response.output_text.done", text=text, logprobs=self._logprobs,
                       **where)
            self._emit("response.content_part.done", part=part, **where)
            item["content"] = [part]
        else:
            self._emit("response.function_call_arguments.done", arguments=text,
                       name=item["name"], **where)
            item["arguments"] = text
        item["status"] = status
        self._emit("response.output_item.done", output_index=self._open["index"],
                   item=dict(item))
        self._open = None

    def _kind(self) -> str | None:
        return self._open["kind"] if self._open is not None else None

    def _emit(self, kind: str, **payload: Any) -> None:
        self.events.append((kind, payload))

    # ------------------------------------------------------------ results
    @property
    def text(self) -> str:
        return "".join(part["text"] for item in self.items if item["type"] == "message"
                       for part in item["content"])

    def assistant_message(self) -> dict[str, Any]:
        """The answer as the chat turn a follow-up's conversation continues with."""
        message: dict[str, Any] = {"role": "assistant", "content": self.text or None}
        if self.calls:
            message["tool_calls"] = self.calls
        elif message["content"] is None:
            message["content"] = ""
        return message


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}
