"""Per-HTTP-request routing context: the session key in, the serving replica out.

`RoutingHeaderMiddleware` (pure ASGI) gives every request a `RoutingContext` in a
context variable before the app runs; the router reads the session key from it
and writes the instance it chose. When the response starts, the middleware adds
`X-Pagoda-Instance: <instance id>` if a replica was chosen (every generation
response, streamed or not, errors after routing included). A streamed response
starts only after its first delta, so the choice is known by then.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

INSTANCE_HEADER = "x-pagoda-instance"
# The prefill replica of a disaggregated request (disagg/prefill_decode.py); absent when colocated.
PREFILL_INSTANCE_HEADER = "x-pagoda-prefill-instance"
SESSION_HEADER = "x-session-id"


@dataclass
class RoutingContext:
    session_key: str | None = None
    instance_id: str | None = None
    prefill_instance_id: str | None = None


_current: contextvars.ContextVar[RoutingContext | None] = contextvars.ContextVar(
    "pagoda_routing_context", default=None)


def current() -> RoutingContext | None:
    """The running HTTP request's context (None outside a request)."""
    return _current.get()


class RoutingHeaderMiddleware:
    passes_body_through = True  # send: start and end only (web/direct_body.py)
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        session = None
        for name, value in scope["headers"]:
            if name == SESSION_HEADER.encode():
                session = value.decode("latin-1")
        context = RoutingContext(session_key=session)
        token = _current.set(context)

        async def send_with_instance(message) -> None:
            if message["type"] == "http.response.start" and context.instance_id:
                headers = list(message.get("headers", []))
                headers.append((INSTANCE_HEADER.encode(), context.instance_id.encode("latin-1")))
                if context.prefill_instance_id:
                    headers.append((PREFILL_INSTANCE_HEADER.encode(),
                                    context.prefill_instance_id.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_instance)
        finally:
            _current.reset(token)
