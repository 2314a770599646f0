"""Qwen3-Coder tool calls (also `qwen3_xml`, `mimo`): XML-ish blocks, one per call,

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Values are bare text (one leading and trailing newline dropped) typed by the tool's
schema (a string when the parameter is not in it, as vLLM does). The name is known
when `<function=NAME>` closes; the arguments grow one parameter at a time.
"""

from __future__ import annotations

import re

from pagoda.services.gateway.openai.tool_parsers.base import (CallSoFar, ParsedOutput, ToolParser,
                                                              finalize)
from pagoda.services.gateway.openai.tool_parsers.tagged import (between, kv_arguments, spans,
                                                                typed_value)

START, END = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    keeps_special_tokens = True  # <tool_call> is an added token in Qwen's tokenizers

    def parse(self, text: str, final: bool) -> ParsedOutput:
        content, found = spans(text, START, END, final)
        out = ParsedOutput(content, [])
        for span in found:
            out.calls.append(self._call(span.body, span.closed))
        return finalize(text, out, final)

    def _call(self, body: str, closed: bool) -> CallSoFar:
        match = _FUNCTION.match(body)
        if match is None:
            return CallSoFar(None)  # malformed when closed; not known yet when open
        name = match.group(1).strip()
        types = self.parameter_types(name)
        pairs = []
        for inner, done in between(body, "<parameter=", "</parameter>", match.end()):
            key, sep, raw = inner.partition(">")
            if not done or not sep:
                break
            raw = raw[1:] if raw.startswith("\n") else raw
            raw = raw[:-1] if raw.endswith("\n") else raw
            pairs.append((key.strip(), typed_value(raw, types.get(key.strip()), True)))
        complete = closed and "</function>" in body
        return CallSoFar(name, kv_arguments(pairs, complete), complete)
