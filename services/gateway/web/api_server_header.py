"""`X-Pagoda-Api-Server: K` on every response of API server K (`--api-server-count` > 1):
which of the gateway's processes answered (tests, debugging). The index, not the pid:
a client learns nothing about the host; the parent's `--api-server-pid-file` and log
map indexes to pids."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-pagoda-api-server"


class ApiServerHeaderMiddleware:
    """Pure ASGI, so a streamed response gets the header too."""

    passes_body_through = True  # send: start and end only (web/direct_body.py)

    def __init__(self, app: ASGIApp, index: int) -> None:
        self.app, self.value = app, str(index).encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (HEADER, self.value)]
            await send(message)

        await self.app(scope, receive, send_with_header)
