"""Pythonic tool calls (Llama 3.2 / Llama 4, ToolACE): the answer is a Python list of
calls, `[get_weather(city="Paris", unit="c"), now()]`, keyword arguments only, literal
values. Arguments become JSON objects; a call's name is known when its `(` opens, its
arguments when its `)` closes."""

from __future__ import annotations

import ast
import json
import re

from pagoda.services.gateway.openai.tool_parsers.base import (CallSoFar, ParsedOutput, ToolParser,
                                                              finalize)

_NAME = re.compile(r"\s*([A-Za-z_][\w.\-]*)\s*\(")
_WRAP = ("<|python_start|>", "<|python_end|>")  # Llama 4 wraps the list in these


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        body = text.strip()
        if body.startswith(_WRAP[0]):
            body = body[len(_WRAP[0]):].removesuffix(_WRAP[1]).strip()
        if not body:
            return ParsedOutput(text if final else "", [])
        if body[0] != "[":
            if not final and _WRAP[0].startswith(body):
                return ParsedOutput()
            return ParsedOutput(text, [])
        calls, i = [], 1
        while True:
            match = _NAME.match(body, i)
            if match is None:
                break
            call = CallSoFar(match.group(1))
            calls.append(call)
            close = _closing_paren(body, match.end())
            if close is None:
                break
            call.arguments = _arguments(body[match.start(1):close + 1])
            call.complete = call.arguments is not None
            call.arguments = call.arguments or ""
            i = close + 1
            while i < len(body) and body[i] in " \t\r\n,":
                i += 1
        return finalize(text, ParsedOutput("", calls), final)


def _arguments(call_text: str) -> str | None:
    """`name(a=1, b="x")` -> '{"a": 1, "b": "x"}'; None if not keyword literals."""
    try:
        node = ast.parse(call_text, mode="eval").body
        if not isinstance(node, ast.Call) or node.args:
            return None
        values = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
    except (SyntaxError, ValueError):
        return None
    if None in values:
        return None
    return json.dumps(values, ensure_ascii=False)


def _closing_paren(text: str, i: int) -> int | None:
    """Index of the `)` closing the call whose arguments start at text[i]."""
    depth, quote = 1, None
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None
