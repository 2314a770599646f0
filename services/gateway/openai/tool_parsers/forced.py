"""The answers of `tool_choice: "required"` and of a named function, and the JSON schemas
that constrain them (so the arguments always parse and follow the tool's schema).

* required: a JSON list of `{"name": <a tool's name>, "parameters": <its arguments>}`
  (at least one; exactly one without `parallel_tool_calls`), vLLM's format;
* named: the answer is the named function's arguments object itself.
"""

from __future__ import annotations

from typing import Any

from pagoda.services.gateway.openai.tool_parsers.base import (CallSoFar, ParsedOutput, ToolParser,
                                                              finalize, json_objects)
from pagoda.services.gateway.openai.tool_parsers.json_scan import skip_ws, value_end

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class RequiredToolParser(ToolParser):
    name = "required"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        i = skip_ws(text, 0)
        if i >= len(text) or text[i] != "[":
            return ParsedOutput(text if final else "", [])
        calls, _ = json_objects(text, i + 1, separators=",")
        return finalize(text, ParsedOutput("", calls), final)


class NamedToolParser(ToolParser):
    name = "named"

    def __init__(self, function_name: str) -> None:
        self.function_name = function_name

    def parse(self, text: str, final: bool) -> ParsedOutput:
        start = skip_ws(text, 0)
        if start >= len(text):
            return ParsedOutput()
        end = value_end(text, start)
        call = CallSoFar(self.function_name, text[start:end if end is not None else len(text)])
        call.arguments = call.arguments.rstrip() if end is None else call.arguments
        call.complete = end is not None
        return finalize(text, ParsedOutput("", [call]), final)


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The schema of a `required` answer; each tool's `$defs` are lifted to the root,
    where its `$ref`s point."""
    defs: dict[str, Any] = {}
    variants = []
    for tool in tools:
        parameters = dict(tool.get("parameters") or EMPTY_PARAMETERS)
        for key, value in parameters.pop("$defs", {}).items():
            if key in defs and defs[key] != value:
                raise ValueError(f"tools: two tools define different $defs.{key}")
            defs[key] = value
        variants.append({"type": "object", "properties": {
            "name": {"type": "string", "enum": [tool["name"]]}, "parameters": parameters},
            "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def named_schema(tool: dict[str, Any]) -> dict[str, Any]:
    return dict(tool.get("parameters") or EMPTY_PARAMETERS)
