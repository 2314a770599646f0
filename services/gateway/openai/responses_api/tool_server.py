"""`--tool-server`: MCP servers whose tools the gateway runs itself (vLLM's flag).

Each entry is `host:port` (vLLM's form: the server's SSE endpoint, http://host:port/sse)
or a full URL (`.../sse` for SSE, anything else for streamable HTTP). A server is
known by its name (the `serverInfo.name` it reports on initialisation), which is the
`server_label` a Responses request names in `{"type": "mcp", "server_label": ...}`.

Every contact is bounded by `timeout` seconds: an unreachable, failing or stalled
server is a `ToolServerError` (the request's clean error), never a hang. The tool
listing is read on first use and kept; each call opens its own session.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from mcp import ClientSession
from mcp.client.sse import sse_client
from mcp.client.streamable_http import streamablehttp_client

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0


class ToolServerError(Exception):
    """A tool server could not be reached or failed; the message names it."""


@dataclass(frozen=True)
class McpTool:
    """One tool of one server: its name, description and JSON-schema input."""

    server_label: str
    name: str
    description: str
    input_schema: dict[str, Any]

    def as_function(self) -> dict[str, Any]:
        """The chat `tools` entry the model sees."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": self.input_schema or {"type": "object", "properties": {}}}}


def server_url(entry: str) -> str:
    entry = entry.strip()
    return entry if entry.startswith(("http://", "https://")) else f"http://{entry}/sse"


class MCPToolServer:
    """The gateway's tool servers. Invariant: `tools()` lists each reachable server's
    tools under its own label; a label is served by exactly one server."""

    def __init__(self, entries: list[str], timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.urls = [server_url(e) for e in entries if e.strip()]
        self.timeout = timeout
        self._labels: dict[str, str] = {}  # label -> url
        self._tools: dict[str, list[McpTool]] = {}  # label -> its tools
        self._lock = asyncio.Lock()

    @asynccontextmanager
    async def _session(self, url: str):
        client = sse_client if url.rstrip("/").endswith("/sse") else streamablehttp_client
        async with client(url) as streams:
            async with ClientSession(streams[0], streams[1]) as session:
                init = await session.initialize()
                yield init.serverInfo.name, session

    async def _bounded(self, url: str, work) -> Any:
        """`work(label, session)` on a fresh session of `url`, within the timeout."""
        async def run():
            async with self._session(url) as (label, session):
                return await work(label, session)
        try:
            return await asyncio.wait_for(run(), self.timeout)
        except asyncio.TimeoutError:
            raise ToolServerError(f"tool server {url} did not answer within "
                                  f"{self.timeout:g} s") from None
        except ToolServerError:
            raise
        except Exception as exc:  # connection refused, protocol errors (as exception groups)
            raise ToolServerError(f"tool server {url} failed: {_reason(exc)}") from None

    async def tools(self) -> dict[str, list[McpTool]]:
        """label -> its tools, listed on first use (a failure is retried next time)."""
        async with self._lock:
            for url in self.urls:
                if url in self._labels.values():
                    continue

                async def listing(label, session):
                    result = await session.list_tools()
                    return label, [McpTool(label, t.name, t.description or "",
                                           dict(t.inputSchema or {})) for t in result.tools]
                label, tools = await self._bounded(url, listing)
                if label in self._labels:
                    raise ToolServerError(f"tool servers {self._labels[label]} and {url} are "
                                          f"both named {label!r}")
                self._labels[label], self._tools[label] = url, tools
                logger.info("tool server %s (%s): %s", label, url, [t.name for t in tools])
            return dict(self._tools)

    async def call(self, label: str, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        """Run tool `name` of server `label`: (its text output, whether it is an error)."""
        async def calling(_, session):
            result = await session.call_tool(name, arguments)
            text = "\n".join(getattr(part, "text", "") for part in result.content
                             if getattr(part, "type", "") == "text")
            return text, bool(result.isError)
        return await self._bounded(self._labels[label], calling)


def _reason(exc: BaseException) -> str:
    """The innermost cause of an exception group, readable."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"
