"""`pagoda gateway`: the OpenAI-compatible HTTP server (FastAPI + uvicorn)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal

import pagoda.envs as envs
import pagoda.tracing as tracing
from pagoda.services.common import grpc_channels, startup_clock
from pagoda.services.common.gc_tuning import prepare_gc_for_serving
from pagoda.services.common.logs import setup_logging
from pagoda.services.gateway import api_servers, event_loop
from pagoda.services.gateway.disagg.prefix_pull import PrefixPullOptions, add_prefix_pull_args
from pagoda.services.gateway.lora.registry import add_lora_args, registry_from_args
from pagoda.services.gateway.observability.metrics import PeerMetrics
from pagoda.services.gateway.routing.router import (DEFAULT_MEDIUM_WEIGHTS, DEFAULT_POLICY,
                                                    POLICIES, parse_medium_weights)
from pagoda.services.gateway.serving_options import (ServingOptions, add_serving_args,
                                                     add_uvicorn_args, uvicorn_kwargs)
from pagoda.services.gateway.web.cors_request_id import HttpOptions, add_http_args
from pagoda.services.gateway.web.api_server_header import ApiServerHeaderMiddleware

DEFAULT_PORT = 8000
logger = logging.getLogger(__name__)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="Listen address.")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="HTTP port.")
    parser.add_argument("--tokenizer-addr", default="127.0.0.1:50051",
                        help="The tokenizer replicas, balanced round-robin with idempotent "
                             "calls retried on another one: host:port (every address the name "
                             "resolves to, e.g. a Kubernetes headless Service), "
                             "dns:///NAME:PORT, or a comma-separated list of IP:PORT.")
    parser.add_argument("--scheduler-addrs", default="127.0.0.1:50052",
                        help="Comma-separated scheduler replicas: host:port; "
                             "dns:///NAME:PORT for every address NAME resolves to (re-resolved "
                             "every few seconds, e.g. a Kubernetes headless Service); or "
                             "k8s://NAMESPACE/SERVICE:PORT for the Service's ready endpoints, "
                             "watched through the Kubernetes API (DNS is the fallback).")
    parser.add_argument("--router", default=DEFAULT_POLICY, choices=POLICIES,
                        help="How requests are spread over the replicas (kv_aware: cached "
                             "prefix against load; session: sticky by X-Session-Id or `user`).")
    parser.add_argument("--kv-cache-manager-addr", default="127.0.0.1:50054",
                        help="host:port of the kv-cache-manager (used by the KV-aware router "
                             "and the prefix-index probe; '' = none).")
    parser.add_argument("--kv-medium-weights", type=_medium_weights, default={},
                        metavar="JSON",
                        help="kv_aware: what a prompt token a replica holds in its KV "
                             "offloading tiers is worth against one in its KV cache (1; "
                             "recompute: 0), by KV event medium: JSON such as "
                             f"'{json.dumps(DEFAULT_MEDIUM_WEIGHTS)}' (the default).")
    add_prefix_pull_args(parser)  # --kv-prefix-pull: needs the kv-cache-manager's index
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="Names clients may use for the model (default: the scheduler's).")
    parser.add_argument("--api-key", default=envs.get("PAGODA_API_KEY"),
                        help="Require `Authorization: Bearer KEY` on /v1/* "
                             "(default: $PAGODA_API_KEY, else $VLLM_API_KEY).")
    parser.add_argument("--peer-metrics", default=None, metavar="SERVICE=HOST:PORT,...",
                        help="Other services' /metrics endpoints to include in this "
                             "gateway's /metrics (one scrape target for a local cluster; "
                             "their series get instance=HOST:PORT).")
    parser.add_argument("--limit-mm-per-prompt", default=None, metavar="JSON",
                        help="vLLM's: most media items per modality in one prompt, e.g. "
                             "'{\"image\": 2}'; more is a 400 before anything is fetched.")
    grpc_channels.add_tls_args(parser)  # to the tokenizer, schedulers, kv-cache-manager
    grpc_channels.add_keepalive_args(parser)
    grpc_channels.add_generate_read_args(parser)  # how long a silent replica is waited for
    tracing.add_cli_args(parser)
    add_http_args(parser)  # CORS: --allowed-origins, --allowed-methods, ...
    add_serving_args(parser)  # vLLM's: --max-logprobs, --enable-log-requests, ...
    add_uvicorn_args(parser)  # vLLM's: --ssl-*, --root-path, --uvicorn-log-level
    add_lora_args(parser)  # vLLM's --lora-modules; the runtime load/unload switch
    parser.add_argument("--api-server-count", "-asc", type=int, default=1,
                        help="vLLM's: gateway processes serving the one port (a parent binds "
                             "it and hands it to each; one that exits is restarted). Metrics "
                             "are summed over them; stored responses and runtime-loaded LoRA "
                             "adapters are shared (api_servers.py).")
    parser.add_argument("--api-server-pid-file", default=None, metavar="PATH",
                        help="With --api-server-count > 1: keep {\"parent\": PID, "
                             "\"api_servers\": {INDEX: PID}} in this file while serving.")


def _medium_weights(text: str) -> dict[str, float]:
    try:
        return parse_medium_weights(text)
    except ValueError as exc:  # argparse prints it and exits 2
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--kv-medium-weights: ")) from None


def main(args: argparse.Namespace) -> int:
    # lazy: every `pagoda` command imports this module for its flags; the server
    # (uvicorn, the FastAPI app and all its routes) loads only when the gateway runs.
    import uvicorn

    from pagoda.services.gateway.app import create_app  # lazy: as uvicorn, above

    setup_logging("gateway")
    startup_clock.mark("imports")
    options = ServingOptions.from_args(args)  # a bad --generation-config fails here
    server_kwargs = uvicorn_kwargs(args)
    inherited = api_servers.child_socket()  # set: this is one of --api-server-count
    if args.api_server_count < 1:
        logger.error("--api-server-count must be at least 1, got %d", args.api_server_count)
        return 2
    if args.api_server_count > 1 and inherited is None:
        return _run_api_servers(args, options.shutdown_grace_period)
    grpc_channels.configure_from_args(args)
    tracing.init_tracing("gateway", args.otlp_traces_endpoint)
    schedulers = [a.strip() for a in args.scheduler_addrs.split(",") if a.strip()]
    if args.kv_prefix_pull and not args.kv_cache_manager_addr:
        logger.warning("--kv-prefix-pull does nothing without the prefix index "
                       "(--kv-cache-manager-addr)")
    fatal: list[str] = []

    def on_fatal(message: str) -> None:  # stop serving: uvicorn shuts down on SIGTERM
        logger.critical("%s", message)
        fatal.append(message)
        os.kill(os.getpid(), signal.SIGTERM)

    app = create_app(args.tokenizer_addr, schedulers, args.served_model_name, args.api_key,
                     args.kv_cache_manager_addr or None, PeerMetrics.parse_list(args.peer_metrics),
                     http_options=HttpOptions.from_args(args), router=args.router,
                     on_fatal=on_fatal, options=options, loras=registry_from_args(args),
                     prefix_pull=PrefixPullOptions.from_args(args),
                     kv_medium_weights=args.kv_medium_weights)
    startup_clock.mark("app")
    scheme = "https" if "ssl_certfile" in server_kwargs else "http"
    logger.info("gateway on %s://%s:%d (tokenizer %s, schedulers %s, router %s)%s", scheme,
                args.host, args.port, args.tokenizer_addr, ", ".join(schedulers), args.router,
                f" as api server {inherited[1]}" if inherited else "")
    if inherited is not None:  # which process answered: X-Pagoda-Api-Server (tests, debugging)
        app.add_middleware(ApiServerHeaderMiddleware, index=inherited[1])
    # uvicorn handles SIGTERM/SIGINT itself (stop accepting, let in-flight requests and
    # streams finish for up to --shutdown-grace-period, run the lifespan exit), then
    # re-raises the signal to the handler it found: make that one a no-op so a clean
    # shutdown exits 0 instead of dying by the signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    config = uvicorn.Config(app, host=args.host, port=args.port,
                            timeout_graceful_shutdown=options.shutdown_grace_period,
                            limit_concurrency=options.limits.limit_concurrency,
                            backlog=api_servers.BACKLOG, loop=event_loop.loop_name(),
                            **server_kwargs)
    prepare_gc_for_serving()  # the app and its imports frozen; fewer gen-0 passes
    uvicorn.Server(config).run(sockets=[inherited[0]] if inherited else None)
    tracing.shutdown_tracing()
    logger.info("gateway stopped")
    return 1 if fatal else 0


def _run_api_servers(args: argparse.Namespace, grace_period: float) -> int:
    """The parent of --api-server-count N: binds the port, runs N gateways on it."""
    try:
        sock = api_servers.bind(args.host, args.port)
    except OSError as exc:
        logger.error("cannot listen on %s:%d: %s", args.host, args.port, exc)
        return 1
    logger.info("gateway on %s:%d: %d api servers", args.host, args.port,
                args.api_server_count)
    parent = api_servers.ApiServers(args.api_server_count, sock, api_servers.child_argv(),
                                    pid_file=args.api_server_pid_file)
    # On SIGTERM each API server lets its streams finish (the grace period), then exits.
    return parent.run(stop_timeout=grace_period + 10.0)
