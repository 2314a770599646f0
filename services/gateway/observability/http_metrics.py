"""HTTP metrics under the names dashboards built for vLLM query.

vLLM instruments its server with prometheus-fastapi-instrumentator's defaults; this
middleware produces the same series without the dependency, beside Pagoda's own
`pagoda_gateway_*` (metrics.py):

  http_requests_total{handler, method, status}        counter; status grouped: "2xx"
  http_request_duration_seconds{handler, method}      histogram, buckets 0.1, 0.5, 1
  http_request_duration_highr_seconds                 histogram, 21 buckets, no labels
  http_request_size_bytes{handler}                    summary of Content-Length in
  http_response_size_bytes{handler}                   summary of Content-Length out

`handler` is the route's template (`/v1/models/{model:path}`), or "none" for a path no
route matches, so labels stay bounded. Like vLLM, /metrics, /health, /load, /ping,
/version and /server_info are not counted. A duration runs from the request's arrival
to its response's last byte (a stream's whole length).
"""

from __future__ import annotations

import time

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, Summary
from starlette.routing import Match
from starlette.types import Message, Receive, Scope, Send

from pagoda.services.common.metrics_server import one_per_process

EXCLUDED_HANDLERS = frozenset({"/metrics", "/health", "/load", "/ping", "/version",
                               "/server_info"})
LOWR_BUCKETS = (0.1, 0.5, 1)
HIGHR_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 2.5, 3, 3.5, 4,
                 4.5, 5, 7.5, 10, 30, 60)


class HttpMetrics:
    """The instrumentator's five default metrics, in one registry."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.requests = Counter("http_requests_total", "Total number of requests by method, "
                                "status and handler.", ["method", "status", "handler"],
                                registry=registry)
        self.duration = Histogram("http_request_duration_seconds", "Latency with only few "
                                  "buckets by handler. Made to be only used if aggregation by "
                                  "handler is important.", ["method", "handler"],
                                  buckets=LOWR_BUCKETS, registry=registry)
        self.duration_highr = Histogram("http_request_duration_highr_seconds", "Latency with "
                                        "many buckets but no API specific labels. Made for more "
                                        "accurate percentile calculations.",
                                        buckets=HIGHR_BUCKETS, registry=registry)
        self.request_size = Summary("http_request_size_bytes", "Content length of incoming "
                                    "requests by handler. Only value of header is respected. "
                                    "Otherwise ignored.", ["handler"], registry=registry)
        self.response_size = Summary("http_response_size_bytes", "Content length of outgoing "
                                     "responses by handler. Only value of header is respected. "
                                     "Otherwise ignored.", ["handler"], registry=registry)


@one_per_process
def http_metrics() -> HttpMetrics:
    """The process's HttpMetrics, in the default registry (created on first use)."""
    return HttpMetrics()


def handler_of(scope: Scope) -> str:
    """The template of the route that served `scope` (the router records it), or for a
    request refused before routing (401, 413), the one that would have; else "none"."""
    route = scope.get("route")
    if route is not None:
        return getattr(route, "path", "none")
    return _match(scope["app"].router.routes, scope) or "none"


def _match(routes, scope: Scope) -> str | None:
    for route in routes:
        nested = getattr(route, "original_router", None) or getattr(route, "app", None)
        if hasattr(nested, "routes") and not hasattr(route, "endpoint"):
            path = _match(nested.routes, scope)  # an included router (no prefix here)
            if path is not None:
                return path
        elif route.matches(scope)[0] == Match.FULL:
            return getattr(route, "path", None)
    return None


class HttpMetricsMiddleware:
    passes_body_through = True  # send: start and end only (web/direct_body.py)
    def __init__(self, app, metrics: HttpMetrics | None = None) -> None:
        self.app = app
        self.metrics = metrics or http_metrics()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status, response_length = 500, None

        async def send_and_watch(message: Message) -> None:
            nonlocal status, response_length
            if message["type"] == "http.response.start":
                status = message["status"]
                response_length = _content_length(message.get("headers", []))
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            seconds = time.perf_counter() - start
            handler = handler_of(scope)
            if handler not in EXCLUDED_HANDLERS:
                self._record(scope, handler, status, seconds, response_length)

    def _record(self, scope: Scope, handler: str, status: int, seconds: float,
                response_length: int | None) -> None:
        method = scope["method"]
        m = self.metrics
        m.requests.labels(method, f"{str(status)[0]}xx", handler).inc()
        m.duration.labels(method, handler).observe(seconds)
        m.duration_highr.observe(seconds)
        request_length = _content_length(scope.get("headers", []))
        if request_length is not None:
            m.request_size.labels(handler).observe(request_length)
        if response_length is not None:
            m.response_size.labels(handler).observe(response_length)


def _content_length(headers) -> int | None:
    for name, value in headers:
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
