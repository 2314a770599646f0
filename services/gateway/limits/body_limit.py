"""413 for a request body over `--max-request-body-bytes` (request_limits.py), before any of it
is parsed."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagoda.services.gateway.errors import error_body


class BodySizeLimitMiddleware:
    """413 for a body over the limit: at once when Content-Length says so, else as
    soon as the bytes read pass it (chunked uploads), before the app parses anything."""

    passes_body_through = True  # send: start and end only (web/direct_body.py)

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
        received, started = 0, False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _TooLarge(self.max_bytes)
            return message

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, watched_send)
        except _TooLarge:
            if not started:
                await self._refuse(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = JSONResponse(error_body(_too_large(self.max_bytes), 413), status_code=413,
                                headers={"Connection": "close"})
        await response(scope, receive, send)


def _too_large(max_bytes: int) -> str:
    return (f"The request body is larger than this server accepts ({max_bytes} bytes, "
            f"--max-request-body-bytes).")


class _TooLarge(HTTPException):
    """Raised inside the app's receive when the body passes the limit: an HTTP error,
    so FastAPI's body reader passes it on as the 413 it is."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, _too_large(max_bytes), headers={"Connection": "close"})
