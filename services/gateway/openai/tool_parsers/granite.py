"""Granite 3.0 / 3.1 tool calls: the answer is a JSON list of calls,
`[{"name": ..., "arguments": {...}}, ...]`, after `<|tool_call|>` (3.0) or `<tool_call>`
(3.1). An answer that is not such a list is plain content, as in vLLM."""

from __future__ import annotations

import json

from pagoda.services.gateway.openai.tool_parsers.base import (ParsedOutput, ToolParser, finalize,
                                                              json_objects)
from pagoda.services.gateway.openai.tool_parsers.json_scan import skip_ws

MARKERS = ("<|tool_call|>", "<tool_call>")


class GraniteToolParser(ToolParser):
    name = "granite"
    keeps_special_tokens = True  # <|tool_call|> is a special token

    def parse(self, text: str, final: bool) -> ParsedOutput:
        i = skip_ws(text, 0)
        for marker in MARKERS:
            if text.startswith(marker, i):
                i = skip_ws(text, i + len(marker))
                break
            if not final and marker.startswith(text[i:]):
                return ParsedOutput()  # (the beginning of) a marker: undecided yet
        if i >= len(text):
            return ParsedOutput(text if final else "", [])
        if text[i] != "[":
            return ParsedOutput(text, [])
        calls, _ = json_objects(text, i + 1, separators=",")
        if final:  # the whole answer must be the list (else vLLM returns it as content)
            try:
                whole = json.loads(text[i:])
            except ValueError:
                whole = None
            if not isinstance(whole, list) or not whole:
                return ParsedOutput(text, [])
        return finalize(text, ParsedOutput("", calls), final)
