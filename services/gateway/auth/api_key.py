"""API-key authentication (vLLM's `--api-key`): `Authorization: Bearer KEY`, or
`x-api-key: KEY` (the header the anthropic SDK sends).

A pure ASGI middleware (streamed responses pass through untouched). Every route
needs the key (/v1/*, /tokenize, /detokenize, and any route added later) except
`/health`, `/version`, `/ping` and `/load`, which probes and load balancers read,
and `/metrics`, which scrapers read unless `--metrics-require-key`. CORS preflights
(OPTIONS) pass so a browser can learn that it must send the header. The key is compared in constant time
(`GatewayState.is_authorized`, hmac.compare_digest).
"""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from pagoda.services.gateway.anthropic.errors import anthropic_error_body
from pagoda.services.gateway.errors import error_body
from pagoda.services.gateway.serving_options import route_path

ANTHROPIC_PREFIX = "/v1/messages"  # its 401 comes in Anthropic's error JSON
# The API description (FastAPI's /docs and its schema) holds no data; vLLM leaves it open.
OPEN_PATHS = frozenset({"/health", "/version", "/ping", "/load", "/docs", "/docs/oauth2-redirect",
                        "/openapi.json", "/redoc"})


class APIKeyMiddleware:
    """401 with OpenAI's error JSON for a guarded route without the right key."""

    passes_body_through = True  # send: start and end only (web/direct_body.py)

    def __init__(self, app: ASGIApp, state) -> None:
        self.app = app
        self.state = state  # a GatewayState: its api_key may be None (no auth)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._needs_key(scope) or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        body = anthropic_error_body if route_path(scope).startswith(ANTHROPIC_PREFIX) \
            else error_body
        response = JSONResponse(
            body("Unauthorized: a valid API key is required "
                 "(Authorization: Bearer KEY, or x-api-key: KEY).", 401),
            status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _needs_key(self, scope: Scope) -> bool:
        if not self.state.api_key or scope["method"] == "OPTIONS":
            return False
        path = route_path(scope)
        if path == "/metrics":
            return self.state.options.metrics_require_key
        return path not in OPEN_PATHS

    def _authorized(self, scope: Scope) -> bool:
        """Either header with the key will do; a wrong one in either is refused only if
        the other does not hold the key."""
        offered = []
        for name, value in scope["headers"]:
            if name == b"authorization":
                offered.append(value.decode("latin-1"))
            elif name == b"x-api-key":
                offered.append(f"Bearer {value.decode('latin-1')}")
        return any(self.state.is_authorized(header) for header in offered) or \
            (not offered and self.state.is_authorized(None))
