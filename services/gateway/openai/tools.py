"""`tools`, `tool_choice` and `parallel_tool_calls`: checked once, turned into a plan.

    tool_choice  "none"      tools reach the chat template; the answer is text
                 "auto"      --enable-auto-tool-choice: --tool-call-parser reads calls out
                             of the answer (tool_parsers/)
                 "required"  the answer is constrained to a list of calls (a JSON schema
                 {function}  built from the tools), so the arguments always parse

Without `tool_choice`, tools mean "auto" when the gateway has a parser, else "none"
(the template still sees them). Malformed tools, an unknown function and a named
choice without tools are 400s naming the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pagoda.services.gateway.errors import APIError
from pagoda.services.gateway.openai.tool_parsers import ToolParser, get_tool_parser
from pagoda.services.gateway.openai.tool_parsers.forced import (NamedToolParser, RequiredToolParser,
                                                                named_schema, required_schema)

# OpenAI's rule for function names.
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
AUTO_NEEDS_FLAGS = ('"auto" tool choice requires --enable-auto-tool-choice and '
                    '--tool-call-parser to be set')


@dataclass
class ToolPlan:
    """What a chat request does with its tools. `constraint`: the StructuredOutputsParams
    keyword arguments of a forced choice; `parser` reads calls out of the answer (None:
    the answer is plain content)."""

    mode: str  # "none" | "auto" | "required" | "named"
    parser: ToolParser | None = None
    constraint: dict[str, Any] | None = None


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """OpenAI's `tools` -> [{"name", "description", "parameters"}]; APIError naming the
    bad field."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise APIError("tools must be a list of tools.", param="tools")
    functions, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise APIError(f"{where} must be a function tool ({{\"type\": \"function\", "
                           f"\"function\": {{...}}}}).", param="tools")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise APIError(f"{where}.function must be an object.", param="tools")
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.match(name):
            raise APIError(f"{where}.function.name must be 1-64 letters, digits, '_' or '-', "
                           f"got {name!r}.", param="tools")
        if name in names:
            raise APIError(f"{where}.function.name {name!r} is used by another tool.",
                           param="tools")
        names.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise APIError(f"{where}.function.parameters must be a JSON schema object.",
                           param="tools")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise APIError(f"{where}.function.description must be a string.", param="tools")
        functions.append({"name": name, "parameters": parameters})
    return functions


def plan_tools(body: Any, auto_parser: str | None) -> ToolPlan:
    """The request's plan; `auto_parser`: the gateway's --tool-call-parser when
    --enable-auto-tool-choice is on, else None. Raises APIError (400)."""
    tools = check_tools(getattr(body, "tools", None))
    choice = getattr(body, "tool_choice", None)
    parallel = getattr(body, "parallel_tool_calls", None) is not False
    if isinstance(choice, dict):
        return _named(choice, tools)
    if choice is None:
        choice = "auto" if tools and auto_parser else "none"
    if choice == "none":
        return ToolPlan("none")
    if not tools:
        raise APIError(f'tool_choice "{choice}" needs tools.', param="tool_choice")
    if choice == "auto":
        if auto_parser is None:
            raise APIError(AUTO_NEEDS_FLAGS, param="tool_choice")
        parser = get_tool_parser(auto_parser, tools)
        return ToolPlan("auto", _SingleCall(parser) if not parallel else parser)
    if choice == "required":
        try:
            schema = required_schema(tools, parallel)
        except ValueError as exc:
            raise APIError(str(exc), param="tools") from None
        return ToolPlan("required", RequiredToolParser(),
                        {"json": schema, "disable_any_whitespace": True})
    raise APIError(f'tool_choice must be "none", "auto", "required" or a named function, '
                   f"got {choice!r}.", param="tool_choice")


def _named(choice: dict[str, Any], tools: list[dict[str, Any]]) -> ToolPlan:
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type", "function") != "function" or not isinstance(name, str):
        raise APIError('A named tool_choice is {"type": "function", "function": {"name": ...}}.',
                       param="tool_choice")
    if not tools:
        raise APIError(f"tool_choice names the function {name!r}, but the request has no "
                       f"tools.", param="tool_choice")
    tool = next((t for t in tools if t["name"] == name), None)
    if tool is None:
        raise APIError(f"tool_choice names the function {name!r}, which is not in tools "
                       f"({', '.join(t['name'] for t in tools)}).", param="tool_choice")
    return ToolPlan("named", NamedToolParser(name),
                    {"json": named_schema(tool), "disable_any_whitespace": True})


class _SingleCall(ToolParser):
    """`parallel_tool_calls: false` with a parser: only the first call is kept."""

    def __init__(self, inner: ToolParser) -> None:
        self.inner = inner
        self.keeps_special_tokens = inner.keeps_special_tokens

    def parse(self, text, final):
        parsed = self.inner.parse(text, final)
        parsed.calls = parsed.calls[:1]
        return parsed


def forced_constraint(body: Any) -> dict[str, Any] | None:
    """The constraint of a `required` or named tool_choice (None for any other); the
    one thing of the plan that reaches the engine. Raises APIError (400)."""
    choice = getattr(body, "tool_choice", None)
    if isinstance(choice, dict) or choice == "required":
        return plan_tools(body, None).constraint
    return None
