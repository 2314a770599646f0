"""A streamed response's body chunks go straight to the server, past the middleware.

Every SSE write of a stream (one per token per stream) went through each middleware's
`send` wrapper: Starlette's error and exception handlers, CORS, the request id, the
two metrics middlewares, the routing headers, the body limit, ... about eight nested
coroutines, ~9% of the gateway's CPU at 256 streams, for messages none of them changes
or reads. Each of those looks at a response's start (status, headers) and at most at
its last body message (`more_body` False).

Invariants:
  * only the body chunks between the start and the last body message skip the stack
    (`DirectStreamingResponse`); the start and the last body message go through every
    middleware as before, so headers, statuses, "completed" and every metric and
    trace are what they were, and every byte the client gets is the same;
  * the skip is on only in an app (`GatewayApp`) whose every middleware says its
    `send` passes body chunks through unchanged (a `passes_body_through = True`
    class attribute, or a Starlette class listed in STARLETTE_PASS_THROUGH); one
    middleware that does not (gzip, a body rewriter) turns it off for the whole app,
    decided when Starlette builds the stack (at its first call, after every
    `add_middleware`, the API server header's included). The stack's own layers
    (Starlette's error and exception middleware, FastAPI's telemetry and body limit:
    fastapi 0.165, starlette 1.10, requirements.lock) look only at the start and the
    last body message too.
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

SEND_KEY = "pagoda.body_send"  # in the scope: the server's own `send`, when the skip is on
# Starlette's own middleware whose `send` only looks at the response's start.
STARLETTE_PASS_THROUGH = (CORSMiddleware,)


def passes_body_through(cls: type) -> bool:
    return cls in STARLETTE_PASS_THROUGH or getattr(cls, "passes_body_through", False) is True


class GatewayApp(FastAPI):
    """FastAPI that hands the server's `send` to a DirectStreamingResponse when every
    middleware lets body chunks through (see the module's invariants)."""

    direct_body = False

    def build_middleware_stack(self):
        self.direct_body = all(passes_body_through(m.cls) for m in self.user_middleware)
        return super().build_middleware_stack()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.middleware_stack is None:  # as Starlette's own call would, first: it decides
            self.middleware_stack = self.build_middleware_stack()
        if scope["type"] == "http" and self.direct_body:
            scope[SEND_KEY] = send
        await super().__call__(scope, receive, send)


class DirectStreamingResponse(StreamingResponse):
    """StreamingResponse whose body chunks go to the server's `send` when the app put
    it in the scope; its start and its end go through the middleware."""

    _body_send: Send | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._body_send = scope.get(SEND_KEY)
        await super().__call__(scope, receive, send)

    async def stream_response(self, send: Send) -> None:
        body_send = self._body_send or send
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            if not isinstance(chunk, bytes | memoryview):
                chunk = chunk.encode(self.charset)
            await body_send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
