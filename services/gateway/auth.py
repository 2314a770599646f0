"""API-key authentication (vLLM's `--api-key`): `Authorization: Bearer KEY` on /v1/*.

A pure ASGI middleware (streamed responses pass through untouched). Only the
OpenAI routes are guarded: `/health`, `/metrics`, `/version` stay open for probes
and scrapers, and CORS preflights (OPTIONS) pass so a browser can learn that it
must send the header. The key is compared in constant time
(`GatewayState.is_authorized`, hmac.compare_digest).
"""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from pagoda.services.gateway.errors import error_body
from pagoda.services.gateway.serving_options import route_path

GUARDED_PREFIX = "/v1/"


class APIKeyMiddleware:
    """401 with OpenAI's error JSON for a guarded route without the right key."""

    def __init__(self, app: ASGIApp, state) -> None:
        self.app = app
        self.state = state  # a GatewayState: its api_key may be None (no auth)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._needs_key(scope) or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        response = JSONResponse(
            error_body("Unauthorized: a valid API key is required "
                       "(Authorization: Bearer KEY).", 401),
            status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _needs_key(self, scope: Scope) -> bool:
        return (bool(self.state.api_key) and scope["method"] != "OPTIONS"
                and route_path(scope).startswith(GUARDED_PREFIX))

    def _authorized(self, scope: Scope) -> bool:
        header = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                header = value.decode("latin-1")
                break
        return self.state.is_authorized(header)
