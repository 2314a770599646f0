"""Responses API input -> the chat path's input: messages, tools and tool_choice.

    input item              chat message
    message (role, content) {"role", "content"} (text parts joined by newlines)
    function_call           an assistant turn's tool_calls entry (consecutive calls, and a
                            call right after the assistant's text, share one turn)
    function_call_output    {"role": "tool", "tool_call_id": call_id, "content": output}
    reasoning               the next assistant turn's reasoning_content

A function tool `{"type": "function", "name", "description", "parameters"}` becomes
chat's `{"type": "function", "function": {...}}`, a named tool_choice
`{"type": "function", "name"}` chat's `{"type": "function", "function": {"name"}}`;
the chat path (tools.py) then checks them as it checks a chat request's. Anything
malformed is an APIError (400) naming the field; a function_call_output must answer a
function_call of the conversation (OpenAI's rule).
"""

from __future__ import annotations

from typing import Any

from pagoda.services.gateway.errors import APIError

# OpenAI's limit on a request's tools.
MAX_TOOLS = 128
ROLES = frozenset({"user", "system", "developer", "assistant"})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "refusal"})
_MAX_ID_CHARS = 256


def input_messages(value: str | list[Any], history: list[dict[str, Any]] | None = None
                   ) -> list[dict[str, Any]]:
    """The request's `input` as chat messages; `history`: the stored conversation of
    `previous_response_id` (the calls a function_call_output may answer)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not value:
        raise APIError("input must not be empty.", param="input")
    calls = {c.get("id") for m in history or () for c in m.get("tool_calls") or ()}
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None  # a reasoning item's text, for the next assistant turn
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(f"{where} must be an object.", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            message = _message(item, where)
            if message["role"] == "assistant" and reasoning:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif kind == "function_call":
            call = _function_call(item, where)
            calls.add(call["id"])
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None, "tool_calls": []}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
            if reasoning:
                last["reasoning_content"], reasoning = reasoning, None
        elif kind == "function_call_output":
            messages.append(_call_output(item, where, calls))
        elif kind == "reasoning":
            reasoning = _reasoning_text(item, where)
        else:
            raise APIError(f"{where}: input items of type {kind!r} are not supported (message, "
                           f"function_call, function_call_output, reasoning).", param="input")
    return messages


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        raise APIError(f"{where}.role must be one of {', '.join(sorted(ROLES))}, got {role!r}.",
                       param="input")
    content = item.get("content")
    if isinstance(content, list):
        content = "\n".join(_part_text(part, f"{where}.content[{j}]")
                            for j, part in enumerate(content))
    elif not isinstance(content, str):
        raise APIError(f"{where}.content must be a string or a list of text parts.",
                       param="input")
    return {"role": role, "content": content}


def _part_text(part: Any, where: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    text = part.get("text", part.get("refusal")) if isinstance(part, dict) else None
    if kind not in _TEXT_PARTS or not isinstance(text, str):
        raise APIError(f"{where}: only text parts (input_text, output_text) are supported, "
                       f"got {kind!r}.", param="input")
    return text


def _call_id(item: dict[str, Any], where: str) -> str:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not 0 < len(call_id) <= _MAX_ID_CHARS:
        raise APIError(f"{where}.call_id must be a string of 1-{_MAX_ID_CHARS} characters.",
                       param="input")
    return call_id


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    call_id = _call_id(item, where)
    name, arguments = item.get("name"), item.get("arguments")
    if not isinstance(name, str) or not name:
        raise APIError(f"{where}.name must be the function's name.", param="input")
    if not isinstance(arguments, str):
        raise APIError(f"{where}.arguments must be a JSON string.", param="input")
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _call_output(item: dict[str, Any], where: str, calls: set) -> dict[str, Any]:
    call_id = _call_id(item, where)
    if call_id not in calls:
        raise APIError(f"{where}: no function call found for function_call_output with "
                       f"call_id {call_id!r}.", param="input")
    output = item.get("output")
    if isinstance(output, list):
        output = "\n".join(_part_text(part, f"{where}.output[{j}]")
                           for j, part in enumerate(output))
    elif not isinstance(output, str):
        raise APIError(f"{where}.output must be a string or a list of text parts.",
                       param="input")
    return {"role": "tool", "tool_call_id": call_id, "content": output}


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its content (reasoning_text parts), else its summary."""
    texts = []
    for field, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(field) or []
        if not isinstance(parts, list):
            raise APIError(f"{where}.{field} must be a list.", param="input")
        for j, part in enumerate(parts):
            if (not isinstance(part, dict) or part.get("type") != part_type
                    or not isinstance(part.get("text"), str)):
                raise APIError(f"{where}.{field}[{j}] must be a {part_type} part.",
                               param="input")
            texts.append(part["text"])
        if texts:
            break
    return "\n".join(texts)


def chat_tools(tools: list[Any]) -> list[dict[str, Any]] | None:
    """Responses function tools -> chat tools (None: no tools)."""
    if len(tools) > MAX_TOOLS:
        raise APIError(f"tools has {len(tools)} tools; at most {MAX_TOOLS} are allowed.",
                       param="tools")
    converted = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "mcp":  # run by the gateway's --tool-server (mcp_turn.py checks it)
            continue
        if kind != "function":
            raise APIError(f"tools[{i}]: only function and mcp tools are supported, got "
                           f"{kind!r}.", param="tools")
        if "function" in tool:  # chat's shape sent to the Responses API
            raise APIError(f"tools[{i}]: a Responses function tool is {{\"type\": "
                           f"\"function\", \"name\", \"parameters\"}} (no nested "
                           f"\"function\").", param="tools")
        if tool.get("strict") not in (None, True, False):
            raise APIError(f"tools[{i}].strict must be a boolean.", param="tools")
        function = {k: tool[k] for k in ("name", "description", "parameters")
                    if tool.get(k) is not None}
        converted.append({"type": "function", "function": function})
    return converted or None


def chat_tool_choice(choice: Any, given: bool) -> str | dict[str, Any] | None:
    """Responses tool_choice -> chat's; `given`: the client set it (unset: chat's default,
    "auto" when the gateway has a tool parser, else "none")."""
    if not given:
        return None
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise APIError(f'tool_choice must be "auto", "none", "required" or '
                           f'{{"type": "function", "name": ...}}, got {choice!r}.',
                           param="tool_choice")
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if not isinstance(name, str):
            raise APIError('A named tool_choice is {"type": "function", "name": ...}.',
                           param="tool_choice")
        return {"type": "function", "function": {"name": name}}
    kind = choice.get("type") if isinstance(choice, dict) else type(choice).__name__
    raise APIError(f"tool_choice of type {kind!r} is not supported (auto, none, required or "
                   f"a function).", param="tool_choice")
