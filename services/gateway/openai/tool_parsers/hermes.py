"""Hermes / Qwen2.5 / Qwen3 tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
one block per call, after optional content; and vLLM's hermes variant `longcat`
(LongCat-Flash), the same JSON calls between `<longcat_tool_call>` tags."""

from __future__ import annotations

from pagoda.services.gateway.openai.tool_parsers.base import (ParsedOutput, ToolParser, finalize,
                                                              held_back, json_call)
from pagoda.services.gateway.openai.tool_parsers.json_scan import skip_ws


class HermesToolParser(ToolParser):
    """Content is the text before the first start tag (vLLM's rule: text after the
    calls is dropped); each call is the JSON object after a start tag."""

    name = "hermes"
    keeps_special_tokens = True  # <tool_call> is an added token in Qwen's tokenizers
    start = "<tool_call>"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        start = self.start
        cut = text.find(start) if final else held_back(text, start)
        if cut < 0:
            return ParsedOutput(text, [])
        out = ParsedOutput(text[:cut], [])
        at = text.find(start, cut)
        while at >= 0:
            call, end = json_call(text, skip_ws(text, at + len(start)))
            if call is None:
                break
            out.calls.append(call)
            if end is None:
                break
            at = text.find(start, end)
        return finalize(text, out, final)


class LongcatToolParser(HermesToolParser):
    """vLLM's `longcat` (LongcatFlashToolParser, a Hermes2ProToolParser with its own tags)."""

    name = "longcat"
    start = "<longcat_tool_call>"
