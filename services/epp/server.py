"""`pagoda epp`: Envoy's ext_proc gRPC service on --port (GIE's default 9002), gRPC health
(services "", "liveness", "readiness" and the ext_proc service name, as GIE's EPP
answers them), /metrics and /health on --metrics-port (GIE's default 9090).

It polls the scheduler replicas, the tokenizer and the kv-cache-manager exactly as a
gateway does (the gateway's `Peers`), and is ready once a replica is routable.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as epb_grpc
from grpc_health.v1 import health, health_pb2_grpc

import pagoda.tracing as tracing
from pagoda.services.common import grpc_channels
from pagoda.services.common.grpc_server import (NOT_SERVING, SERVING, add_server_args, bind,
                                                metrics_host)
from pagoda.services.common.logs import setup_logging
from pagoda.services.common.metrics_server import MetricsServer
from pagoda.services.epp.endpoints import EndpointResolver, parse_endpoint_map
from pagoda.services.epp.ext_proc import ExternalProcessor
from pagoda.services.epp.metrics import EppMetrics
from pagoda.services.epp.picker import Picker, SaturationThresholds
from pagoda.services.gateway.routing.peers import Peers
from pagoda.services.gateway.routing.router import DEFAULT_POLICY, POLICIES

DEFAULT_PORT = 9002
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_NAMES = ("", "liveness", "readiness", EXT_PROC_SERVICE)
logger = logging.getLogger(__name__)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_server_args(parser, DEFAULT_PORT)
    parser.add_argument("--tokenizer-addr", default="127.0.0.1:50051",
                        help="The tokenizer replicas (as `pagoda gateway --tokenizer-addr`).")
    parser.add_argument("--scheduler-addrs", default="127.0.0.1:50052",
                        help="The pool's scheduler replicas (as `pagoda gateway "
                             "--scheduler-addrs`: host:port list, dns:///NAME:PORT or "
                             "k8s://NAMESPACE/SERVICE:PORT).")
    parser.add_argument("--kv-cache-manager-addr", default="127.0.0.1:50054",
                        help="The cluster prefix index ('' = route on load only).")
    parser.add_argument("--router", default=DEFAULT_POLICY, choices=POLICIES,
                        help="The policy that picks among the candidates (as the gateway's).")
    parser.add_argument("--target-port", type=int, default=8000,
                        help="The InferencePool's targetPorts: a member's endpoint is its "
                             "scheduler's host at this port (the pod's gateway).")
    parser.add_argument("--endpoint-map", default=None,
                        metavar="SCHED_HOST:PORT=IP:PORT,...",
                        help="Explicit endpoints for some scheduler replicas (members that "
                             "share no host with their scheduler, e.g. on one loopback).")
    parser.add_argument("--pool-name", default="pagoda",
                        help="The InferencePool's name (the `name` label of inference_pool_*).")
    parser.add_argument("--queue-depth-threshold", type=int, default=5,
                        help="A replica with this many waiting requests is saturated (GIE's "
                             "saturation detector).")
    parser.add_argument("--kv-cache-util-threshold", type=float, default=0.8,
                        help="A replica with its KV cache this full is saturated.")
    parser.add_argument("--objective-priority", default="", metavar="NAME=PRIORITY,...",
                        help="InferenceObjective priorities by the x-gateway-inference-"
                             "objective header; below 0 is sheddable (429 when saturated).")
    parser.add_argument("--default-priority", type=int, default=0,
                        help="Priority of a request naming no known objective.")


def parse_priorities(text: str) -> dict[str, int]:
    out = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        name, sep, value = entry.partition("=")
        try:
            out[name.strip()] = int(value)
        except ValueError:
            raise ValueError(f"--objective-priority entry {entry!r} is not NAME=INT") from None
        if not sep or not name.strip():
            raise ValueError(f"--objective-priority entry {entry!r} is not NAME=INT")
    return out


def main(args: argparse.Namespace) -> int:
    setup_logging("epp")
    try:
        overrides = parse_endpoint_map(args.endpoint_map)
        priorities = parse_priorities(args.objective_priority)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    grpc_channels.configure_from_args(args)
    tracing.init_tracing("epp", args.otlp_traces_endpoint)
    return asyncio.run(_serve(args, EndpointResolver(args.target_port, overrides), priorities))


async def _serve(args: argparse.Namespace, resolver: EndpointResolver,
                 priorities: dict[str, int]) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    fatal: list[str] = []

    def on_fatal(message: str) -> None:
        logger.critical("%s", message)
        fatal.append(message)
        stop.set()

    peers = Peers(args.tokenizer_addr, args.scheduler_addrs, args.router, on_fatal)
    if args.kv_cache_manager_addr:
        peers.use_prefix_index(args.kv_cache_manager_addr)
    picker = Picker(peers, resolver, SaturationThresholds(args.queue_depth_threshold,
                                                          args.kv_cache_util_threshold))
    metrics = EppMetrics(args.pool_name, picker.ready_replicas, resolver.endpoint)
    server = grpc_channels.aio_server()
    epb_grpc.add_ExternalProcessorServicer_to_server(
        ExternalProcessor(picker, metrics, priorities, args.default_priority), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = bind(server, args.host, args.port)
    await server.start()
    peers.start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    http = (MetricsServer(metrics_host(args), args.metrics_port, peers.is_healthy,
                          metrics.registry).start() if args.metrics_port else None)
    logger.info("epp listening on %s:%d (schedulers %s, router %s, target port %d)",
                args.host, port, args.scheduler_addrs, args.router, args.target_port)
    ready = None
    while not stop.is_set():
        if peers.is_healthy() != ready:  # readiness follows the pool (GIE: datastore synced)
            ready = peers.is_healthy()
            for name in HEALTH_NAMES:
                await health_servicer.set(name, SERVING if ready or name == "liveness"
                                          else NOT_SERVING)
            logger.info("epp %s", "ready" if ready else f"not ready: {peers.not_ready_reason()}")
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except asyncio.TimeoutError:
            pass
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace=5.0)
    await peers.close()
    if http is not None:
        http.stop()
    tracing.shutdown_tracing()
    logger.info("epp stopped")
    return 1 if fatal else 0
