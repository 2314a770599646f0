"""HTTP-level options of the gateway: CORS and X-Request-Id (vLLM's flags).

- CORS: `--allowed-origins`, `--allowed-methods`, `--allowed-headers`,
  `--allow-credentials`, with vLLM's defaults (everything allowed, no credentials).
  Each list flag takes a JSON list (as vLLM does) or a comma-separated list.
- X-Request-Id: a request's header (when it is a sane token) becomes its id; else
  one is made up. Either way the response carries it back, the OpenAI response id
  is built from it (`cmpl-<id>`), and routes read it from `request.state`.

Order (outermost first): CORS -> request id -> the app's other middleware, so
that error responses (a 401 too) carry both the CORS headers and the id.
"""

from __future__ import annotations

import argparse
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starlette.datastructures import MutableHeaders
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:  # the CLI imports this module to build its parser: keep it light
    from fastapi import FastAPI

REQUEST_ID_HEADER = "X-Request-Id"
# What a client's X-Request-Id may be: visible ASCII, no spaces, bounded length
# (it becomes part of the scheduler's request ids and of log lines).
_REQUEST_ID_RE = re.compile(r"^[\x21-\x7e]{1,128}$")


@dataclass
class HttpOptions:
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "HttpOptions":
        return cls(args.allowed_origins, args.allowed_methods, args.allowed_headers,
                   args.allow_credentials)


def parse_list(value: str) -> list[str]:
    """A JSON list (vLLM's form) or a comma-separated list."""
    value = value.strip()
    if value.startswith("["):
        try:
            items = json.loads(value)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not a JSON list: {exc}") from None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise argparse.ArgumentTypeError("expected a JSON list of strings")
        return items
    return [item.strip() for item in value.split(",") if item.strip()]


def add_http_args(parser: argparse.ArgumentParser) -> None:
    d = HttpOptions()
    parser.add_argument("--allowed-origins", type=parse_list, default=d.allowed_origins,
                        help='CORS allowed origins, e.g. \'["https://a.example"]\' or '
                             '"https://a.example,https://b.example" (default: *).')
    parser.add_argument("--allowed-methods", type=parse_list, default=d.allowed_methods,
                        help="CORS allowed methods (default: *).")
    parser.add_argument("--allowed-headers", type=parse_list, default=d.allowed_headers,
                        help="CORS allowed headers (default: *).")
    parser.add_argument("--allow-credentials", action="store_true",
                        help="CORS: allow credentials (cookies, Authorization).")


def http_flags(args: argparse.Namespace) -> list[str]:
    """The HTTP flags the user changed, re-rendered for the gateway (`pagoda serve`)."""
    d, flags = HttpOptions(), []
    for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
        value = getattr(args, name)
        if value != getattr(d, name):
            flags += [f"--{name.replace('_', '-')}", json.dumps(value)]
    if args.allow_credentials:
        flags.append("--allow-credentials")
    return flags


class RequestIdMiddleware:
    """Puts the request id in `scope["state"]` and the X-Request-Id response header."""

    passes_body_through = True  # send: start and end only (web/direct_body.py)

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = _client_request_id(scope)
        request_id = given or uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        state["request_id_from_client"] = given is not None

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)


def _client_request_id(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            text = value.decode("latin-1")
            return text if _REQUEST_ID_RE.match(text) else None
    return None


def install_http_middleware(app: "FastAPI", options: HttpOptions | None) -> None:
    """Add last (after the app's other middleware): these two wrap everything."""
    options = options or HttpOptions()
    app.add_middleware(RequestIdMiddleware)
    app.add_middleware(CORSMiddleware, allow_origins=options.allowed_origins,
                       allow_methods=options.allowed_methods,
                       allow_headers=options.allowed_headers,
                       allow_credentials=options.allow_credentials,
                       expose_headers=[REQUEST_ID_HEADER])
