"""Llama 3.1/3.2 JSON tool calls: the whole answer is `{"name": ..., "parameters": {...}}`
(optionally after `<|python_tag|>`), several separated by `;`. An answer that does not
open with `{` is plain content."""

from __future__ import annotations

from pagoda.services.gateway.openai.tool_parsers.base import (ParsedOutput, ToolParser, finalize,
                                                              json_objects)
from pagoda.services.gateway.openai.tool_parsers.json_scan import skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        i = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, i):
            i = skip_ws(text, i + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[i:]):
            return ParsedOutput()  # nothing but (the beginning of) the tag yet: undecided
        if i >= len(text):
            return ParsedOutput(text if final else "", [])
        if text[i] != "{":
            return ParsedOutput(text, [])
        calls, _ = json_objects(text, i, separators=";,")
        return finalize(text, ParsedOutput("", calls), final)
