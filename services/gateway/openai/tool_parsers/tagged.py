"""Pieces shared by the formats that wrap each call in marker tokens (deepseek_v3,
kimi_k2, qwen3_coder, glm45, ...): finding the wrapped spans in a growing text, the
content around them, streaming key/value arguments as JSON, and typing bare values.

Content rule (for every format built on `spans`): the text before the first call is
content as written; text between or after calls is content too, with the whitespace
that separates it from the calls stripped (so `</tool_call>\\n<tool_call>` adds nothing,
and `...</tool_call>\\nDone.` adds `Done.`). While streaming, what may still turn out to
be a marker or trailing whitespace is held back, so the content only ever grows.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from typing import Any

from pagoda.services.gateway.openai.tool_parsers.base import held_back


@dataclass
class Span:
    """A wrapped part of the text: its body so far, and whether its end marker came."""

    body: str
    closed: bool


def spans(text: str, start: str, end: str, final: bool) -> tuple[str, list[Span]]:
    """(the content outside `start`...`end`, the spans in order). The last span may be
    open (its end marker not yet generated); then nothing after it is content."""
    content, found, i = "", [], 0
    while True:
        at = text.find(start, i)
        segment = text[i:at] if at >= 0 else text[i:]
        if at < 0 and not final:
            segment = segment[:held_back(segment, start)]
        # After a call, the whitespace around the text is the calls' separator (a
        # growing tail's trailing whitespace may yet be one, so it waits too).
        content += segment if i == 0 else segment.strip()
        if at < 0:
            return content, found
        body_at = at + len(start)
        stop = text.find(end, body_at)
        if stop < 0:
            found.append(Span(text[body_at:], False))
            return content, found
        found.append(Span(text[body_at:stop], True))
        i = stop + len(end)


def kv_arguments(pairs: list[tuple[str, Any]], complete: bool) -> str:
    """The arguments JSON of parameters read one by one: while the call is open, the
    JSON of those complete so far without its closing brace (a prefix of the final
    text, since json.dumps writes members in order)."""
    text = json.dumps(dict(pairs), ensure_ascii=False)
    return text if complete else text[:-1]


_STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}


def typed_value(raw: str, schema_type: Any, default_string: bool) -> Any:
    """A bare parameter value as its schema type says (a string when the schema says
    string; when the parameter is unknown, a string if `default_string`, else what it
    parses as: JSON, a Python literal, or the text)."""
    kind = schema_type if isinstance(schema_type, str) else None
    if kind in _STRING_TYPES or (kind is None and default_string):
        return raw
    if raw.lower() == "null":
        return None
    if kind == "boolean":
        return raw.strip().lower() == "true"
    if kind in ("integer", "number"):
        try:
            number = float(raw)
        except ValueError:
            return raw
        return int(number) if kind == "integer" or number.is_integer() and "." not in raw \
            else number
    try:
        return json.loads(raw)
    except ValueError:
        pass
    try:
        return ast.literal_eval(raw)
    except (SyntaxError, ValueError):
        return raw


def between(text: str, start: str, end: str, i: int = 0) -> list[tuple[str, bool]]:
    """Every `start`...`end` inside `text` from `i`: (inner text, whether closed)."""
    out = []
    while True:
        at = text.find(start, i)
        if at < 0:
            return out
        stop = text.find(end, at + len(start))
        if stop < 0:
            out.append((text[at + len(start):], False))
            return out
        out.append((text[at + len(start):stop], True))
        i = stop + len(end)
