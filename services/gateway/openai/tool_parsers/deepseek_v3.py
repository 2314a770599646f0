"""DeepSeek-V3 / R1 tool calls: a section of calls after optional content,

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

and DeepSeek-V3.1's form of each call (`deepseek_v31`):
`<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>`.
"""

from __future__ import annotations

from pagoda.services.gateway.openai.tool_parsers.base import (CallSoFar, ParsedOutput, ToolParser,
                                                              finalize)
from pagoda.services.gateway.openai.tool_parsers.json_args import json_arguments
from pagoda.services.gateway.openai.tool_parsers.tagged import spans

SECTION = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
CALL = ("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>")
SEP = "<｜tool▁sep｜>"
FENCE = ("```json", "```")


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"
    keeps_special_tokens = True  # the markers are special tokens

    def parse(self, text: str, final: bool) -> ParsedOutput:
        content, sections = spans(text, *SECTION, final)
        out = ParsedOutput(content, [])
        for section in sections:
            _, calls = spans(section.body, *CALL, True)
            out.calls += [self._call(c.body, c.closed) for c in calls]
            if section.closed and not calls:
                out.calls.append(CallSoFar(None))  # an empty section: malformed
        return finalize(text, out, final)

    def _call(self, body: str, closed: bool) -> CallSoFar:
        kind, sep, rest = body.partition(SEP)
        if not sep:
            return CallSoFar(None)
        if kind.strip() != "function":  # V3.1: name<｜tool▁sep｜>{...}
            return json_arguments(kind.strip(), rest, closed)
        name, newline, rest = rest.partition("\n")
        if not newline:
            return CallSoFar(None)
        rest = rest.lstrip()
        if not rest.startswith(FENCE[0]):
            return CallSoFar(name.strip() if FENCE[0].startswith(rest) else None)
        rest = rest[len(FENCE[0]):]
        fence_end = rest.rfind(FENCE[1])
        inner = rest[:fence_end] if fence_end >= 0 else rest.removesuffix("`").removesuffix("`")
        return json_arguments(name.strip(), inner, closed and fence_end >= 0)


class DeepSeekV31ToolParser(DeepSeekV3ToolParser):
    name = "deepseek_v31"
