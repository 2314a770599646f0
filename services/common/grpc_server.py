"""The lifecycle every gRPC service shares: listen, report health, stop on SIGTERM.

Invariant: a service reports SERVING on the gRPC health protocol only while it can
answer; on SIGTERM/SIGINT it flips to NOT_SERVING, lets in-flight calls finish
(`grace` seconds), then exits.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pagoda import tracing
from pagoda.services.common.metrics_server import maybe_start_metrics
from pagoda.services.common.tracing import server_interceptors

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # gRPC sets SO_REUSEPORT by default, which lets a second server bind a port
    # that is in use and silently split its traffic. Fail loudly instead.
    ("grpc.so_reuseport", 0),
]
# Channels to peers: a peer that is still starting (or restarting) is retried
# within ~1 s, not after gRPC's default exponential backoff of up to 2 minutes.
CLIENT_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
# Channels that read token streams (gateway -> scheduler `Generate`): a tiny HTTP/2
# read-ahead window, so a reader that falls behind blocks the sender after a few
# messages and the scheduler coalesces the backlog into one chunk, instead of
# queueing thousands of one-token messages. (Large messages are unaffected: the
# window opens to fit a message being read.)
STREAM_READER_OPTIONS = CLIENT_OPTIONS + [
    ("grpc.http2.lookahead_bytes", 64),
    ("grpc.http2.bdp_probe", 0),
]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def add_server_args(parser: argparse.ArgumentParser, default_port: int) -> None:
    """The flags every gRPC service takes (the Helm chart relies on these names)."""
    parser.add_argument("--host", default="127.0.0.1", help="Listen address.")
    parser.add_argument("--port", type=int, default=default_port, help="gRPC port.")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="HTTP port for /metrics and /health (0 = off).")
    tracing.add_cli_args(parser)


def stop_event_on_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT (call from the main thread)."""
    stop = threading.Event()

    def handler(signum, _frame) -> None:
        logger.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def bind(server: Any, host: str, port: int) -> int:
    """Bind the insecure port or raise with the address in the message."""
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as exc:  # grpc raises RuntimeError when it cannot bind
        raise SystemExit(f"cannot listen on {host}:{port}: {exc}") from exc
    if bound == 0:
        raise SystemExit(f"cannot listen on {host}:{port}")
    return bound


def serve_sync(
    name: str,
    args: argparse.Namespace,
    servicers: Iterable[tuple[Callable[[Any, grpc.Server], None], Any, str]],
    max_workers: int = 8,
    on_stop: Callable[[], None] | None = None,
    grace: float = 5.0,
) -> None:
    """Run a thread-pool gRPC server with health checking until SIGTERM/SIGINT.

    `servicers`: (add_XServicer_to_server, servicer, full service name) triples.
    """
    stop = stop_event_on_signals()
    if not tracing.is_enabled():  # a service that makes traced calls turned it on earlier
        tracing.init_tracing(name, getattr(args, "otlp_traces_endpoint", None))
    server = grpc.server(ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name),
                         options=GRPC_OPTIONS, interceptors=server_interceptors())
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [""]
    for add, servicer, service_name in servicers:
        add(servicer, server)
        names.append(service_name)
    port = bind(server, args.host, args.port)
    server.start()
    for service_name in names:
        health_servicer.set(service_name, SERVING)
    metrics = maybe_start_metrics(args.host, args.metrics_port, lambda: not stop.is_set())
    logger.info("%s listening on %s:%d", name, args.host, port)
    stop.wait()
    health_servicer.enter_graceful_shutdown()
    server.stop(grace).wait()
    if metrics is not None:
        metrics.stop()
    if on_stop is not None:
        on_stop()
    tracing.shutdown_tracing()  # flush the spans still buffered
    logger.info("%s stopped", name)
