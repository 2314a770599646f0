"""The gateway's metrics and request spans, and `/metrics` for the whole local cluster.

`pagoda_gateway_*`: HTTP requests by route, method and status, their duration,
in-flight requests, requests rejected (by reason) and aborted by the client,
choices migrated to another replica mid-stream (by reason, migration.py);
`pagoda_router_*`: routing decisions by policy and replica (the label is `replica`,
not `instance`, which Prometheus reserves for the scrape target), and the cached
prompt tokens the prefix index predicted for the chosen replica against those the
replica really found (both fed by router_dispatch.py).

`ObservabilityMiddleware` (pure ASGI, so it sees a streamed response end) counts
every request and, while tracing is on, runs it inside a SERVER span continuing
the client's W3C `traceparent`, so the tokenizer and scheduler calls join it.

`render_cluster_metrics` answers `/metrics`: the gateway's own registry plus, with
`--peer-metrics`, every peer service's `/metrics`, each peer's series labelled
`instance=<its metrics address>` (scrape with `honor_labels: true`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, \
    generate_latest

import pagoda.tracing as tracing
from pagoda.metrics.aggregate import render
from pagoda.services.common.metrics_server import one_per_process
from pagoda.services.gateway.observability.multiprocess import metrics_registry
from pagoda.services.gateway.disagg.labels import DISAGG_FALLBACK_KINDS, HANDSHAKE_MISMATCH_FIELDS
from pagoda.services.gateway.serving_options import route_path

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/tokenize",
          "/detokenize", "/health", "/metrics", "/version", "/ping", "/load")
GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
REJECT_REASONS = {400: "invalid_request", 404: "invalid_request", 422: "invalid_request",
                  401: "unauthorized", 429: "overloaded", 503: "unavailable"}
MIGRATION_REASONS = ("replica_lost", "replica_failed", "drain_timeout")
CLIENT_CLOSED = 499  # the status the gateway reports when the client went away
DURATION_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                    300.0]


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.http_requests = Counter(
            "pagoda_gateway_http_requests", "HTTP requests answered, by route, method and status.",
            ["route", "method", "status"], registry=registry)
        self.http_duration = Histogram(
            "pagoda_gateway_http_request_duration_seconds",
            "Seconds from a request's arrival to the last byte of its response.", ["route"],
            buckets=DURATION_BUCKETS, registry=registry)
        self.in_flight = Gauge("pagoda_gateway_requests_in_flight",
                               "HTTP requests being answered.", ["route"], registry=registry,
                               multiprocess_mode="livesum")  # over the API servers
        self.rejected = Counter(
            "pagoda_gateway_requests_rejected",
            "Generation requests refused: invalid_request, unauthorized, overloaded (429), "
            "unavailable (503).", ["reason"], registry=registry)
        self.aborted = Counter("pagoda_gateway_requests_aborted",
                               "Generation requests whose client went away before the end.",
                               ["route"], registry=registry)
        self.routing_decisions = Counter(
            "pagoda_router_decisions", "Scheduler replicas chosen, by routing policy and replica.",
            ["policy", "replica"], registry=registry)
        self.cached_tokens = Counter(
            "pagoda_router_cached_tokens",
            "Prompt tokens of probed requests found in the chosen replica's prefix cache: "
            "kind=predicted (by the cluster prefix index) or kind=actual (by the replica).",
            ["kind"], registry=registry)
        self.migrations = Counter(
            "pagoda_gateway_migrations",
            "Choices moved to another replica mid-stream, by why their replica stopped: "
            "replica_lost (connection lost or silent), replica_failed (its engine failed), "
            "drain_timeout (it shut down before they finished).", ["reason"],
            registry=registry)
        self.disagg_fallbacks = Counter(
            "pagoda_gateway_disagg_fallbacks",
            "Disaggregated choices whose decode replica computed the prompt itself, by why: "
            "no_prefill_replica, prefill_failed, media_recompute (the decode replica "
            "lacked an image's KV and got its pixels after all; the replicas' own transfer "
            "failures are pagoda_kv_transfer_fallbacks_total).", ["kind"], registry=registry)
        self.disagg_handshake_mismatches = Counter(
            "pagoda_gateway_disagg_handshake_mismatches",
            "Prefill/decode replica pairs that cannot exchange KV blocks (counted once per "
            "pair of incarnations), by the field they disagree on: model, kv_connector, "
            "device_type, kv_dtype, block_size, num_layers, num_kv_heads, head_dim, layout, "
            "prefix_hash_seed.", ["field"], registry=registry)
        self.kv_prefix_pulls = Counter(
            "pagoda_gateway_kv_prefix_pulls",
            "--kv-prefix-pull: requests sent with a lease on another replica's cached prefix "
            "blocks (leased), or without one because the lease failed (lease_failed: the "
            "replica is gone, slow or refused) or it held too few blocks (too_few_blocks). "
            "The pulls themselves are pagoda_kv_transfer_*.", ["result"], registry=registry)
        self.kv_prefix_tier_pulls = Counter(
            "pagoda_gateway_kv_prefix_tier_pulls",
            "--kv-prefix-pull: of pagoda_gateway_kv_prefix_pulls_total, the leases asked of a "
            "replica holding part of the prefix in its host/disk KV tier (it onloads them "
            "first), by the same results.", ["result"], registry=registry)
        self.peer_up = Gauge("pagoda_metrics_peer_up",
                             "1 if the last scrape of a peer's /metrics through the gateway "
                             "worked.", ["service", "peer"], registry=registry,
                             multiprocess_mode="mostrecent")  # the latest scrape, any process
        for reason in set(REJECT_REASONS.values()):
            self.rejected.labels(reason)
        for route in GENERATION_ROUTES:  # series that exist before the first request
            # A 500 too: the dashboards' 5xx ratio reads 0 (not "No data") until one.
            self.http_requests.labels(route, "POST", "500")
            self.aborted.labels(route)
            self.http_duration.labels(route)
            self.in_flight.labels(route)
        for kind in ("predicted", "actual"):
            self.cached_tokens.labels(kind)
        for reason in MIGRATION_REASONS:
            self.migrations.labels(reason)
        for result in ("leased", "lease_failed", "too_few_blocks"):
            self.kv_prefix_pulls.labels(result)
            self.kv_prefix_tier_pulls.labels(result)
        for kind in DISAGG_FALLBACK_KINDS:
            self.disagg_fallbacks.labels(kind)
        for field in HANDSHAKE_MISMATCH_FIELDS:
            self.disagg_handshake_mismatches.labels(field)

    def observe_response(self, route: str, method: str, status: int, seconds: float,
                         completed: bool) -> None:
        self.http_requests.labels(route, method, str(status)).inc()
        self.http_duration.labels(route).observe(seconds)
        if route in GENERATION_ROUTES:
            if status == CLIENT_CLOSED or not completed:
                self.aborted.labels(route).inc()
            elif status in REJECT_REASONS:
                self.rejected.labels(REJECT_REASONS[status]).inc()


@one_per_process
def gateway_metrics() -> GatewayMetrics:
    """The process's GatewayMetrics, in the default registry (created on first use)."""
    return GatewayMetrics()


def route_of(path: str) -> str:
    """A bounded label: the known route, else "other"."""
    return path if path in ROUTES else "other"


class ObservabilityMiddleware:
    """Counts and (when tracing is on) traces every HTTP request."""

    passes_body_through = True  # send: start and end only (web/direct_body.py)

    def __init__(self, app, metrics: GatewayMetrics | None = None) -> None:
        self.app = app
        self.metrics = metrics or gateway_metrics()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route, method = route_of(route_path(scope)), scope["method"]
        status, completed = 500, False
        span, token = self._start_span(scope, route, method)

        async def send_and_watch(message) -> None:
            nonlocal status, completed
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                completed = True
            await send(message)

        start = time.perf_counter()
        gauge = self.metrics.in_flight.labels(route)
        gauge.inc()
        try:
            await self.app(scope, receive, send_and_watch)
        except Exception:
            status, completed = 500, True  # answered with an error, not left by the client
            raise
        finally:
            gauge.dec()
            self.metrics.observe_response(route, method, status, time.perf_counter() - start,
                                          completed)
            if span is not None:
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(Status(StatusCode.ERROR))
                otel_context.detach(token)
                span.end()

    @staticmethod
    def _start_span(scope, route: str, method: str):
        if not tracing.is_enabled():
            return None, None
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        parent = tracing.extract(headers)
        span = tracing.get_tracer().start_span(
            f"{method} {route}", context=parent, kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "http.route": route,
                        "url.path": scope["path"]})
        return span, otel_context.attach(trace.set_span_in_context(span, parent))


# ---------------------------------------------------------------- cluster /metrics
@dataclass(frozen=True)
class PeerMetrics:
    """A peer's metrics endpoint: `service=host:port` on the command line."""

    service: str
    address: str

    @classmethod
    def parse_list(cls, text: str | None) -> list["PeerMetrics"]:
        peers = []
        for item in (text or "").split(","):
            if item.strip():
                service, sep, address = item.strip().partition("=")
                if not sep or not service or not address:
                    raise ValueError(f"--peer-metrics wants SERVICE=HOST:PORT, got {item!r}")
                peers.append(cls(service, address))
        return peers


async def render_cluster_metrics(peers: list[PeerMetrics], client: httpx.AsyncClient,
                                 metrics: GatewayMetrics | None = None,
                                 registry: CollectorRegistry | None = None) -> bytes:
    """This process's metrics merged with each reachable peer's (fetched concurrently;
    an unreachable peer is left out and marked down in `pagoda_metrics_peer_up`)."""
    metrics = metrics or gateway_metrics()

    async def fetch(peer: PeerMetrics) -> str | None:
        try:
            reply = await client.get(f"http://{peer.address}/metrics", timeout=2.0)
            reply.raise_for_status()
            return reply.text
        except httpx.HTTPError:
            return None

    texts = await asyncio.gather(*(fetch(p) for p in peers))
    for peer, text in zip(peers, texts):
        metrics.peer_up.labels(peer.service, peer.address).set(0 if text is None else 1)
    own = generate_latest(registry or metrics_registry()).decode()
    if not peers:
        return own.encode()
    sources = [({}, own)] + [({"instance": p.address}, t)
                             for p, t in zip(peers, texts) if t is not None]
    return render(sources)
