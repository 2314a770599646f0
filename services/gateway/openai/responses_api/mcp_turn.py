"""A Responses request with MCP tools (`{"type": "mcp", "server_label": ...}`) served by
the gateway's `--tool-server`: the gateway runs the tools itself, as vLLM's Responses
API does with tool servers.

    tools of the named servers ─► chat tools (tool_choice auto, --tool-call-parser)
    loop: generate ─► the answer's tool calls? ─ no ─► the final message
                         └ yes: call each on its server, append the assistant's calls
                                and each result as a tool message, generate again

The response's `output` holds one `mcp_call` item per call (name, arguments, output
or error: OpenAI's item) and then the final message; usage sums every round. The
rounds are bounded (MAX_ROUNDS), and the calls by the request's `max_tool_calls`: a
model that keeps calling gets an incomplete response (reason "max_tool_calls"), the
calls past the limit not run. A tool server that cannot be reached while listing is a
424 (OpenAI's status for a failed MCP server); a failing call is that call's `error`,
which the model sees as the tool's result. Only non-streamed requests run tools here.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from fastapi import Request

from pagoda.services.gateway.errors import APIError
from pagoda.services.gateway.openai import routes as openai_routes
from pagoda.services.gateway.openai.responses_api.models import (ResponsesRequest,
                                                                 response_object,
                                                                 to_chat_request, usage_object)
from pagoda.services.gateway.openai.responses_api.output_items import output_message
from pagoda.services.gateway.openai.responses_api.tool_server import (MCPToolServer, McpTool,
                                                                      ToolServerError)
from pagoda.services.gateway.state import GatewayState

MAX_ROUNDS = 10


def mcp_entries(body: ResponsesRequest) -> list[dict[str, Any]]:
    return [t for t in body.tools if isinstance(t, dict) and t.get("type") == "mcp"]


async def selected_tools(server: MCPToolServer | None, body: ResponsesRequest) -> list[McpTool]:
    """The tools the request's mcp entries name (`allowed_tools` filters a server's)."""
    if server is None:
        raise APIError("tools of type mcp run on the gateway's tool servers; start it with "
                       "--tool-server.", param="tools")
    try:
        available = await server.tools()
    except ToolServerError as exc:
        raise APIError(f"Error retrieving tool list from MCP server: {exc}", 424,
                       param="tools") from None
    chosen: dict[str, McpTool] = {}
    for entry in mcp_entries(body):
        label = entry.get("server_label")
        if label not in available:
            raise APIError(f"tools: no tool server is named {label!r} (serving: "
                           f"{', '.join(sorted(available)) or 'none'}).", param="tools")
        allowed = entry.get("allowed_tools")
        if isinstance(allowed, dict):
            allowed = allowed.get("tool_names")
        for tool in available[label]:
            if allowed is None or tool.name in allowed:
                if tool.name in chosen and chosen[tool.name].server_label != label:
                    raise APIError(f"tools: servers {label!r} and "
                                   f"{chosen[tool.name].server_label!r} both have a tool "
                                   f"{tool.name!r}.", param="tools")
                chosen[tool.name] = tool
    return list(chosen.values())


async def respond_with_tools(state: GatewayState, body: ResponsesRequest, model: str,
                             messages: list[dict], request: Request,
                             server: MCPToolServer | None) -> tuple[dict, list[dict]]:
    """(the response object, the conversation to store) of a request with MCP tools."""
    if body.stream:
        raise APIError("stream is not supported with tools of type mcp.", param="stream")
    tools = {t.name: t for t in await selected_tools(server, body)}
    response_id, created = f"resp_{uuid.uuid4().hex}", int(time.time())
    output: list[dict] = []
    usage = [0, 0, 0]
    messages = list(messages)
    calls_left = body.max_tool_calls
    for _ in range(MAX_ROUNDS):
        chat = to_chat_request(body, messages, [t.as_function() for t in tools.values()],
                               state.peers.model_info().max_model_len)
        chat.stream = False
        run = await openai_routes.start_chat(state, chat, request, "resp")
        choice = (await openai_routes.collect(run.gen, request))[0]
        for i, n in enumerate((run.gen.usage.prompt_tokens, run.gen.usage.completion_tokens,
                               run.gen.usage.cached_tokens)):
            usage[i] += n
        message, _ = run.output.message(choice.text, choice.finish_reason)
        calls = [c for c in message.get("tool_calls") or () if c["function"]["name"] in tools]
        if not calls:
            text = message.get("content") or ""
            incomplete = choice.finish_reason == "length"
            output.append(output_message(f"msg_{uuid.uuid4().hex}", text,
                                         "incomplete" if incomplete else "completed"))
            messages.append({"role": "assistant", "content": text})
            return _response(body, response_id, model, created, output, usage,
                             "max_output_tokens" if incomplete else None), messages
        if calls_left is not None and len(calls) > calls_left:
            break
        calls_left = None if calls_left is None else calls_left - len(calls)
        messages.append({"role": "assistant", "content": message.get("content") or "",
                         "tool_calls": calls})
        for call in calls:
            item = await _run_call(server, tools[call["function"]["name"]],
                                   call["function"]["arguments"])
            output.append(item)
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": item["output"] if item["error"] is None
                             else f"Error: {item['error']}"})
    return _response(body, response_id, model, created, output, usage,
                     "max_tool_calls"), messages


async def _run_call(server: MCPToolServer, tool: McpTool, arguments: str) -> dict[str, Any]:
    """One call as OpenAI's `mcp_call` output item."""
    item = {"id": f"mcp_{uuid.uuid4().hex}", "type": "mcp_call",
            "server_label": tool.server_label, "name": tool.name, "arguments": arguments,
            "output": None, "error": None}
    try:
        text, failed = await server.call(tool.server_label, tool.name, json.loads(arguments))
    except ToolServerError as exc:
        item["error"] = str(exc)
        return item
    item["error" if failed else "output"] = text
    return item


def _response(body: ResponsesRequest, response_id: str, model: str, created: int,
              output: list[dict], usage: list[int], incomplete: str | None) -> dict:
    return response_object(body, response_id, model, created,
                           "incomplete" if incomplete else "completed", output,
                           usage_object(*usage), incomplete)
