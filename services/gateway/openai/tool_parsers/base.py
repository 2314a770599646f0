"""The tool-call parser contract, and the one streaming driver every parser shares.

A parser reads the answer text so far and says what of it is final (`ParsedOutput`):
the content before the tool calls, and each call's name and the stable prefix of its
arguments' JSON text. The driver (`ToolCallStream`) turns successive parses into
OpenAI deltas: content as it becomes final, `tool_calls[i]` with id, type and
`function.name` once, then argument fragments that join into the call's arguments.
The non-streamed answer is the same parse with `final=True`, so both agree.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pagoda.services.gateway.openai.tool_parsers.json_scan import scan_object, skip_ws


def tool_call_id() -> str:
    """vLLM's tool-call id format."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class CallSoFar:
    """A tool call as far as it is known: `name` None until complete; `arguments` a
    prefix of the final arguments JSON text (all of it once `complete`)."""

    name: str | None
    arguments: str = ""
    complete: bool = False


@dataclass
class ParsedOutput:
    """What of the text is final. Invariant (for a growing text): `content` only grows
    by appending; a call's name, once set, stays; its arguments only grow."""

    content: str = ""
    calls: list[CallSoFar] = field(default_factory=list)


class ToolParser(ABC):
    """One model family's tool-call format (`--tool-call-parser NAME`)."""

    name: ClassVar[str] = ""
    # The format's markers are special tokens the decoder must keep (vLLM's adjust_request).
    keeps_special_tokens: ClassVar[bool] = False

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        # The request's functions ({"name", "parameters"}): formats whose argument values
        # are bare text (qwen3_coder, glm45) read each parameter's JSON type from them.
        self.tools = tools or []

    def parameter_types(self, function: str) -> dict[str, Any]:
        """`function`'s parameters -> their JSON schema `type` (empty if unknown)."""
        for tool in self.tools:
            if tool.get("name") == function:
                props = (tool.get("parameters") or {}).get("properties") or {}
                return {k: v.get("type") for k, v in props.items() if isinstance(v, dict)}
        return {}

    @abstractmethod
    def parse(self, text: str, final: bool) -> ParsedOutput:
        """Parse the answer so far; `final`: the whole answer (nothing is held back, and a
        malformed call makes the whole text content)."""


# ---------------------------------------------------------------- shared pieces
def held_back(text: str, marker: str) -> int:
    """Where `text` must stop being content: before `marker`, or before a suffix that
    may be its beginning."""
    at = text.find(marker)
    if at >= 0:
        return at
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return len(text) - n
    return len(text)


def json_call(text: str, start: int, args_keys: tuple[str, ...] = ("arguments", "parameters")
              ) -> tuple[CallSoFar | None, int | None]:
    """The call in the JSON object at text[start] ({"name": ..., "arguments": {...}}):
    (the call so far or None if not an object, the object's end or None while open)."""
    obj = scan_object(text, start)
    if obj is None:
        return None, None
    name, args = None, None
    for m in obj.members:
        if m.key == "name" and m.value_end is not None:
            try:
                value = json.loads(text[m.value_start:m.value_end])
            except ValueError:
                return None, obj.end
            name = value if isinstance(value, str) else None
        elif m.key in args_keys:
            args = m
    call = CallSoFar(name)
    if args is not None:
        raw = text[args.value_start:args.value_end if args.value_end is not None else len(text)]
        if text[args.value_start] == '"':  # arguments as a JSON string: only whole
            if args.value_end is not None:
                call.arguments = json.loads(raw)
        elif text[args.value_start] in "{[":
            call.arguments = raw.rstrip() if args.value_end is None else raw
    if obj.end is not None:
        call.complete = name is not None
        if args is None:
            call.arguments = "{}"
    return call, obj.end


def valid_calls(calls: list[CallSoFar]) -> bool:
    """Every call complete, named, with arguments that are a JSON object."""
    for call in calls:
        if not call.complete or not call.name:
            return False
        try:
            if not isinstance(json.loads(call.arguments), dict):
                return False
        except ValueError:
            return False
    return True


def finalize(text: str, parsed: ParsedOutput, final: bool) -> ParsedOutput:
    """With `final`, a malformed or incomplete call turns the whole text into content
    (vLLM's rule: nothing half-parsed is returned as a call)."""
    if final and parsed.calls and not valid_calls(parsed.calls):
        return ParsedOutput(text, [])
    return parsed


def json_objects(text: str, start: int, separators: str = ",;") -> tuple[list[CallSoFar], bool]:
    """Consecutive call objects from text[start] separated by `separators`/whitespace:
    (the calls, whether the text stopped being such a sequence)."""
    calls, i = [], skip_ws(text, start)
    while i < len(text):
        if text[i] in separators:
            i = skip_ws(text, i + 1)
            continue
        call, end = json_call(text, i)
        if call is None:
            return calls, True
        calls.append(call)
        if end is None:
            return calls, False
        i = skip_ws(text, end)
    return calls, False


# ---------------------------------------------------------------- streaming
@dataclass
class _Sent:
    id: str
    name_sent: bool = False
    arguments_sent: int = 0


class ToolCallStream:
    """Diffs successive parses of one choice's growing answer into OpenAI deltas.

    Invariant: every delta is final: the content deltas join into the final content,
    each call's name goes out once (with its id), and its argument fragments join into
    its final arguments.
    """

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self._content_sent = 0
        self._calls: list[_Sent] = []

    @property
    def num_calls(self) -> int:
        return sum(1 for c in self._calls if c.name_sent)

    def feed(self, delta: str, final: bool = False) -> list[dict[str, Any]]:
        self.text += delta
        parsed = self.parser.parse(self.text, final)
        if final and not parsed.calls and self.num_calls:
            parsed = self.parser.parse(self.text, False)  # calls already went out: keep them
        out: list[dict[str, Any]] = []
        if len(parsed.content) > self._content_sent:
            out.append({"content": parsed.content[self._content_sent:]})
            self._content_sent = len(parsed.content)
        for index, call in enumerate(parsed.calls):
            if index == len(self._calls):
                self._calls.append(_Sent(tool_call_id()))
            sent = self._calls[index]
            if call.name is None:
                break  # later calls wait for this one's name (indexes stay in order)
            item: dict[str, Any] = {"index": index}
            if not sent.name_sent:
                sent.name_sent = True
                item.update(id=sent.id, type="function", function={"name": call.name,
                                                                   "arguments": ""})
            fragment = call.arguments[sent.arguments_sent:]
            if fragment:
                item.setdefault("function", {})["arguments"] = fragment
                sent.arguments_sent = len(call.arguments)
            if len(item) > 1:
                out.append({"tool_calls": [item]})
        return out
