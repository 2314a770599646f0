"""GLM-4.5 / 4.6 / 4.7 tool calls (`glm45`, `glm47`): one block per call, the name on
its first line, then key/value pairs,

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

A value is a string when the tool's schema says so; otherwise it is read as JSON (or a
Python literal), falling back to the text, as vLLM does.
"""

from __future__ import annotations

from pagoda.services.gateway.openai.tool_parsers.base import (CallSoFar, ParsedOutput, ToolParser,
                                                              finalize)
from pagoda.services.gateway.openai.tool_parsers.tagged import (between, kv_arguments, spans,
                                                                typed_value)

START, END = "<tool_call>", "</tool_call>"
KEY, VALUE = ("<arg_key>", "</arg_key>"), ("<arg_value>", "</arg_value>")


class Glm45ToolParser(ToolParser):
    name = "glm45"
    keeps_special_tokens = True  # <tool_call>, <arg_key>, ... are added tokens

    def parse(self, text: str, final: bool) -> ParsedOutput:
        content, found = spans(text, START, END, final)
        out = ParsedOutput(content, [])
        for span in found:
            out.calls.append(self._call(span.body, span.closed))
        return finalize(text, out, final)

    def _call(self, body: str, closed: bool) -> CallSoFar:
        ends = [i for i in (body.find("\n", len(body) - len(body.lstrip())), body.find(KEY[0]))
                if i >= 0]
        name_end = min(ends) if ends else (len(body) if closed else -1)
        name = body[:name_end].strip() if name_end >= 0 else ""
        if not name:
            return CallSoFar(None)
        types = self.parameter_types(name)
        keys = between(body, *KEY, name_end)
        values = between(body, *VALUE, name_end)
        pairs = []
        for (key, key_done), (raw, value_done) in zip(keys, values):
            if not (key_done and value_done):
                break
            pairs.append((key.strip(), typed_value(raw, types.get(key.strip()), False)))
        malformed = closed and (len(keys) != len(values) or len(pairs) != len(keys))
        return CallSoFar(None if malformed else name, kv_arguments(pairs, closed), closed)
