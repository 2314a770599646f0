"""Hermes / Qwen2.5 / Qwen3 tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
one block per call, after optional content."""

from __future__ import annotations

from pagoda.services.gateway.openai.tool_parsers.base import (ParsedOutput, ToolParser, finalize,
                                                              held_back, json_call)
from pagoda.services.gateway.openai.tool_parsers.json_scan import skip_ws

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    keeps_special_tokens = True  # <tool_call> is an added token in Qwen's tokenizers

    def parse(self, text: str, final: bool) -> ParsedOutput:
        cut = text.find(START) if final else held_back(text, START)
        if cut < 0:
            return ParsedOutput(text, [])
        out = ParsedOutput(text[:cut], [])
        at = text.find(START, cut)
        while at >= 0:
            call, end = json_call(text, skip_ws(text, at + len(START)))
            if call is None:
                break
            out.calls.append(call)
            if end is None:
                break
            at = text.find(START, end)
        return finalize(text, out, final)
