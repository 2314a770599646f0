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
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

import pagoda.tracing as tracing
from pagoda.services.common import grpc_channels, startup_clock
from pagoda.services.common.grpc_channels import (CLIENT_OPTIONS, MAX_MESSAGE_BYTES,  # noqa: F401
                                                  SERVER_OPTIONS, STREAM_READER_OPTIONS)
from pagoda.services.common.metrics_server import maybe_start_metrics

logger = logging.getLogger(__name__)

# Re-exported: the options live with the channels and servers they configure.
GRPC_OPTIONS = SERVER_OPTIONS
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def add_server_args(parser: argparse.ArgumentParser, default_port: int) -> None:
    """The flags every gRPC service takes (the Helm chart relies on these names)."""
    parser.add_argument("--host", default="127.0.0.1", help="Listen address.")
    parser.add_argument("--port", type=int, default=default_port, help="gRPC port.")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="HTTP port for /metrics and /health (0 = off).")
    parser.add_argument("--metrics-host", default=None,
                        help="Listen address of --metrics-port (default: --host). A service "
                             "that serves gRPC on 127.0.0.1 only can still be probed here.")
    grpc_channels.add_tls_args(parser)
    grpc_channels.add_keepalive_args(parser)
    tracing.add_cli_args(parser)


def metrics_host(args: argparse.Namespace) -> str:
    return getattr(args, "metrics_host", None) or args.host


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
    """Listen on host:port (TLS when configured, see grpc_channels) or raise with the
    address in the message."""
    try:
        bound = grpc_channels.add_port(server, f"{host}:{port}")
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
    main_loop: Callable[[threading.Event], None] | None = None,
) -> None:
    """Run a thread-pool gRPC server with health checking until SIGTERM/SIGINT.

    `servicers`: (add_XServicer_to_server, servicer, full service name) triples.
    `main_loop(stop)`, if given, runs on the calling thread while the server serves
    and must return soon after `stop` is set (the gpu-worker's model calls).
    """
    stop = stop_event_on_signals()
    grpc_channels.configure_from_args(args)
    if not tracing.is_enabled():  # a service that makes traced calls turned it on earlier
        tracing.init_tracing(name, getattr(args, "otlp_traces_endpoint", None))
    server = grpc_channels.server(max_workers, thread_name_prefix=name)
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
    metrics = maybe_start_metrics(metrics_host(args), args.metrics_port,
                                  lambda: not stop.is_set())
    logger.info("%s listening on %s:%d", name, args.host, port)
    startup_clock.mark("gRPC server")
    startup_clock.report("serving")
    if main_loop is not None:
        main_loop(stop)
    stop.wait()
    health_servicer.enter_graceful_shutdown()
    server.stop(grace).wait()
    if metrics is not None:
        metrics.stop()
    if on_stop is not None:
        on_stop()
    tracing.shutdown_tracing()  # flush the spans still buffered
    logger.info("%s stopped", name)
