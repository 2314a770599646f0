"""Kimi-K2 tool calls: a section of calls, each named by its id `functions.NAME:INDEX`,

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
    <|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>
"""

from __future__ import annotations

from pagoda.services.gateway.openai.tool_parsers.base import (CallSoFar, ParsedOutput, ToolParser,
                                                              finalize)
from pagoda.services.gateway.openai.tool_parsers.json_args import json_arguments
from pagoda.services.gateway.openai.tool_parsers.tagged import spans

SECTION = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
CALL = ("<|tool_call_begin|>", "<|tool_call_end|>")
ARGUMENTS = "<|tool_call_argument_begin|>"


class KimiK2ToolParser(ToolParser):
    name = "kimi_k2"
    keeps_special_tokens = True

    def parse(self, text: str, final: bool) -> ParsedOutput:
        content, sections = spans(text, *SECTION, final)
        out = ParsedOutput(content, [])
        for section in sections:
            _, calls = spans(section.body, *CALL, True)
            out.calls += [self._call(c.body, c.closed) for c in calls]
            if section.closed and not calls:
                out.calls.append(CallSoFar(None))
        return finalize(text, out, final)

    @staticmethod
    def _call(body: str, closed: bool) -> CallSoFar:
        call_id, sep, rest = body.partition(ARGUMENTS)
        if not sep:
            return CallSoFar(None)
        # functions.get_weather:0 -> get_weather (vLLM's reading of the id)
        name = call_id.strip().split(":")[0].split(".")[-1]
        return json_arguments(name, rest, closed)
