"""Scanning JSON that is still being generated: where a value ends, if it has ended.

Tool-call parsers read a model's output while it streams, so they need to know which
part of a JSON object is final: a member's key once its string closed, a value's raw
text up to where it ends (or up to the end of the text so far, when it has not ended).
The raw text of an object value is a prefix of its final text at every moment, which
is what lets argument fragments be streamed and still join into the exact JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

WHITESPACE = " \t\r\n"
_CLOSE = {"{": "}", "[": "]"}


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def value_end(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at text[i], or None if the text ends
    before it does. Assumes well-formed JSON; only brackets and strings are tracked."""
    if i >= len(text):
        return None
    first = text[i]
    if first == '"':
        return _string_end(text, i)
    if first in _CLOSE:
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i  # a number or a literal: it ends at a delimiter
    while j < len(text) and text[j] not in ",}] \t\r\n":
        j += 1
    return j if j < len(text) else None


def _string_end(text: str, i: int) -> int | None:
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == '"':
            return j + 1
        j += 1
    return None


@dataclass
class Member:
    """One member of an object being scanned: `value_end` None while it is open."""

    key: str
    value_start: int
    value_end: int | None


@dataclass
class ScannedObject:
    members: list[Member]
    end: int | None  # after the closing brace; None while open


def scan_object(text: str, i: int) -> ScannedObject | None:
    """The members of the object starting at text[i] (which must be '{') so far. Only
    members whose key is complete are listed; None if text[i] is not '{'."""
    if i >= len(text) or text[i] != "{":
        return None
    members: list[Member] = []
    j = skip_ws(text, i + 1)
    while j < len(text):
        if text[j] == "}":
            return ScannedObject(members, j + 1)
        if text[j] == ",":
            j = skip_ws(text, j + 1)
            continue
        if text[j] != '"':
            return ScannedObject(members, None)  # malformed: stop here
        key_end = _string_end(text, j)
        if key_end is None:
            break
        colon = skip_ws(text, key_end)
        if colon >= len(text) or text[colon] != ":":
            break
        start = skip_ws(text, colon + 1)
        if start >= len(text):
            break
        end = value_end(text, start)
        try:
            key = json.loads(text[j:key_end])
        except ValueError:
            return ScannedObject(members, None)  # malformed: stop here
        members.append(Member(key, start, end))
        if end is None:
            break
        j = skip_ws(text, end)
    return ScannedObject(members, None)
