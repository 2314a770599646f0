"""A tiny HTTP server for a gRPC service's `/metrics` and `/health`, and
`one_per_process`, which every service's metrics getter uses.

The gRPC health protocol is what peers use; this endpoint is for Prometheus and
for HTTP probes (Kubernetes, `curl`). It runs in a daemon thread and costs
nothing until scraped. It serves the default registry, where each service keeps
its metrics object, one per process.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import TypeVar
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest

logger = logging.getLogger(__name__)

T = TypeVar("T")


def one_per_process(make: Callable[[], T]) -> Callable[[], T]:
    """Decorator: `make()` runs on the first call, under a lock; every call returns that
    one object. Metrics need this: Prometheus takes a name once per registry, so a
    second object in the default registry raises, and so would two threads that both
    asked first."""
    lock = threading.Lock()
    made: list[T] = []

    @functools.wraps(make)
    def get() -> T:
        if not made:
            with lock:
                if not made:
                    made.append(make())
        return made[0]

    return get


class MetricsServer:
    """Serves GET /metrics (Prometheus text of `registry`, which may be replaced before
    `start`) and GET /health (200 or 503)."""

    def __init__(self, host: str, port: int, is_healthy: Callable[[], bool],
                 registry: CollectorRegistry = REGISTRY) -> None:
        is_healthy_fn = is_healthy
        self.registry = registry
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.split("?")[0] == "/metrics":
                    self._reply(200, generate_latest(server.registry), CONTENT_TYPE_LATEST)
                elif self.path.split("?")[0] == "/health":
                    ok = is_healthy_fn()
                    self._reply(200 if ok else 503, b"ok\n" if ok else b"unhealthy\n")
                else:
                    self._reply(404, b"not found\n")

            def _reply(self, status: int, body: bytes, ctype: str = "text/plain") -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # scrapes are not worth a log line
                pass

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True,
                                        name="metrics-http")

    def start(self) -> "MetricsServer":
        self._thread.start()
        logger.info("metrics on http://%s:%d/metrics", self._httpd.server_address[0], self.port)
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def maybe_start_metrics(host: str, port: int, is_healthy: Callable[[], bool]
                        ) -> MetricsServer | None:
    """Start a MetricsServer unless `port` is 0 (off)."""
    if not port:
        return None
    return MetricsServer(host, port, is_healthy).start()
