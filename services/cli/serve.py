"""`pagoda serve [MODEL]`: the whole cluster on this machine, one process per service.

Starts a private Redis (unless `--redis-url`; supervised like the services), the
kv-cache-manager,
`--tokenizer-replicas` tokenizers (the gateway balances over them and retries an
idempotent call on another),
`--data-parallel-size` model replicas (a gpu-worker and a scheduler each) and the
gateway (routing with `--router`) on free loopback ports (the gateway on
`--host:--port`), waits until each is healthy, prints the URL, and stops them all
on Ctrl-C/SIGTERM. A service that exits is restarted with its own command line
(local_cluster.py, supervision.py: backoff, `--max-restarts` per `--restart-window`);
one that keeps exiting stops the rest and `pagoda serve` exits 1, naming it and
quoting its last log lines -- or, with several replicas, that replica is retired and
the others serve on. `pagoda_service_restarts_total{service}` counts the restarts
(on the gateway's /metrics, through the supervisor's own metrics endpoint).
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import ssl
import sys
import threading

import pagoda.envs as envs
import pagoda.tracing as tracing
from pagoda.services.cli.download import hub_flags, prefetch_for_serve
from pagoda.services.scheduler.kv_events_config import parse_kv_events_config
from pagoda.services.cli.serve_roles import (add_role_args, plan_replicas, role_problem,
                                             scheduler_kv_flags)
from pagoda.services.cli.local_cluster import LocalCluster, ServiceFailed, ServiceProcess
from pagoda.services.cli.supervision import RestartPolicy
from pagoda.services.common.metrics_server import MetricsServer
from pagoda.metrics import stat_logger
from pagoda.services.common.grpc_channels import (GrpcTLS, Keepalive, add_generate_read_args,
                                                  add_keepalive_args, add_tls_args,
                                                  generate_read_flags)
from pagoda.services.common.grpc_channels import configure_from_args as configure_grpc_tls
from pagoda.services.common.redis_url import REDIS_PASSWORD_ENV, REDIS_URL_ENV
from pagoda.services.gateway.disagg.prefix_pull import add_prefix_pull_args, prefix_pull_flags
from pagoda.services.gateway.lora.registry import add_lora_args, lora_flags
from pagoda.services.gateway.routing.router import (DEFAULT_POLICY, POLICIES,
                                                     parse_medium_weights)
from pagoda.services.gateway.web.cors_request_id import add_http_args, http_flags
from pagoda.services.tokenizer.server import (add_media_args, add_template_limit_args,
                                              media_flags, template_limit_flags)
from pagoda.services.gateway.serving_options import (ServingOptions, add_serving_args,
                                                     add_uvicorn_args, gateway_flags,
                                                     uvicorn_kwargs)
from pagoda.config import StructuredOutputsConfig
from pagoda.engine.arg_utils import EngineArgs, TRUST_REMOTE_CODE_REFUSED
from pagoda.reasoning.budget import ReasoningConfig
from pagoda.services.common import startup_clock
from pagoda.free_ports import free_port
from pagoda.services.common.redis_server import PrivateRedis
from pagoda.tokenizer.chat_template import load_chat_template


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve", help="Run every service locally and serve the OpenAI API.",
        description=__doc__.split("\n\n")[0])
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="HF safetensors directory, GGUF file or Hugging Face model id "
                             "ORG/NAME, downloaded once before the services start (default: "
                             "SmolLM2-135M-Instruct).")
    parser.add_argument("--host", default="127.0.0.1", help="The gateway's listen address.")
    parser.add_argument("--port", type=int, default=8000, help="The gateway's HTTP port.")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="Names clients may use for the model.")
    parser.add_argument("--redis-url", default=os.environ.get(REDIS_URL_ENV),
                        help="Redis for the prefix index (default: $PAGODA_REDIS_URL, else "
                             "start a private one with a random password). A password goes "
                             "in $REDIS_PASSWORD or in a URL given through $PAGODA_REDIS_URL.")
    parser.add_argument("--api-key", default=envs.get("PAGODA_API_KEY"),
                        help="Require `Authorization: Bearer KEY` (default: $PAGODA_API_KEY, "
                             "else $VLLM_API_KEY).")
    parser.add_argument("--startup-timeout", type=float,
                        default=envs.get("PAGODA_ENGINE_READY_TIMEOUT_S"),
                        help="Seconds to wait for every service to become healthy (default: "
                             "$PAGODA_ENGINE_READY_TIMEOUT_S, else $VLLM_ENGINE_READY_TIMEOUT_S, "
                             "else 900).")
    parser.add_argument("--chat-template", default=None,
                        help="Chat template instead of the model's: a file or the template "
                             "itself (passed to the tokenizer).")
    add_template_limit_args(parser)  # passed to the tokenizer
    add_media_args(parser)  # passed to the tokenizer (--limit-mm-per-prompt: the gateway too)
    parser.add_argument("--tokenizer-replicas", type=int, default=DEFAULT_TOKENIZER_REPLICAS,
                        help="Tokenizer processes (each about 400 MiB resident with the default "
                             "model): the gateway spreads calls over them round-robin, and a "
                             "call that meets a dead one is retried on another, so one "
                             "tokenizer dying or restarting fails no request.")
    parser.add_argument("--api-server-count", "-asc", type=int, default=1,
                        help="vLLM's: gateway processes serving the one HTTP port (for a "
                             "gateway that runs out of CPU: each process streams and "
                             "detokenizes its own connections). One that exits is restarted "
                             "by the gateway's parent; only its own streams fail.")
    parser.add_argument("--api-server-pid-file", default=None, metavar="PATH",
                        help="With --api-server-count > 1: the gateway keeps "
                             "{\"parent\": PID, \"api_servers\": {INDEX: PID}} here.")
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                        help="Model replicas: each is a scheduler and its gpu-worker, behind the "
                             "one gateway. With several, a replica that exits is reported and "
                             "the rest keep serving.")
    parser.add_argument("--router", default=DEFAULT_POLICY, choices=POLICIES,
                        help="How the gateway spreads requests over the replicas.")
    parser.add_argument("--kv-medium-weights", default=None, metavar="JSON",
                        help="kv_aware routing: what a prompt token held in a replica's KV "
                             "offloading tiers is worth against one in its KV cache, by "
                             "medium, e.g. '{\"CPU\": 0.8, \"DISK\": 0.5}' (the gateway's "
                             "default).")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="A scheduler told to stop (SIGTERM) gives its in-flight requests "
                             "this many seconds to finish; the rest move to other replicas.")
    parser.add_argument("--execute-model-timeout", type=float, default=None, metavar="SECONDS",
                        help="Deadline of one model step (passed to the schedulers; default "
                             "300, 0: none): a replica whose step runs longer fails, and its "
                             "streams move to other replicas.")
    parser.add_argument("--kv-events-config", default=None,
                        help="vLLM's KV events JSON, passed to every scheduler (replica i "
                             "publishes on the endpoint's port + i, as vLLM's DP ranks do).")
    add_role_args(parser)
    add_supervision_args(parser)
    add_prefix_pull_args(parser.add_argument_group(
        "cluster-wide prefix cache (passed to the gateway)"))
    group = parser.add_argument_group("engine (passed to the scheduler and the gpu-worker)")
    EngineArgs.add_cli_args(group)
    add_http_args(parser.add_argument_group("HTTP (passed to the gateway)"))
    add_serving_args(parser, engine_shared=False)  # passed to the gateway
    add_uvicorn_args(parser)  # passed to the gateway
    add_lora_args(parser)  # passed to the gateway (--enable-lora etc. are engine flags)
    add_tls_args(parser)  # passed to every service
    add_keepalive_args(parser)  # passed to every service
    add_generate_read_args(parser)  # passed to the gateway
    observability = parser.add_argument_group(
        "observability (the gateway's /metrics includes every service's)")
    stat_logger.add_cli_args(observability)
    tracing.add_cli_args(observability)
    parser.set_defaults(func=run)
    return parser


DEFAULT_TOKENIZER_REPLICAS = 2


def add_supervision_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "supervision (a service that exits is restarted, like a pod's container)")
    group.add_argument("--max-restarts", type=int, default=5,
                       help="Restarts of one service (a model replica counts as one) within "
                            "--restart-window seconds; one more exit is a crash loop: "
                            "`pagoda serve` stops, naming the service (0: never restart).")
    group.add_argument("--restart-window", type=float, default=60.0, metavar="SECONDS",
                       help="The window --max-restarts counts in.")
    group.add_argument("--restart-backoff", type=float, default=0.5, metavar="SECONDS",
                       help="Wait before a restart; doubles with each restart in the window "
                            "(at most 30 s).")


def restart_policy(args: argparse.Namespace) -> RestartPolicy:
    return RestartPolicy(max_restarts=args.max_restarts, window_s=args.restart_window,
                         backoff_s=args.restart_backoff)


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags the user set, re-rendered for the scheduler and the worker."""
    reference = EngineArgs.add_cli_args(argparse.ArgumentParser(add_help=False))
    flags: list[str] = []
    for action in reference._actions:
        if not action.option_strings or action.dest == "model":
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = next(o for o in action.option_strings if o.startswith("--"))
        if isinstance(action, argparse.BooleanOptionalAction):
            flags.append(flag if value else f"--no-{flag[2:]}")
        elif isinstance(action, argparse._StoreTrueAction):
            flags.append(flag)
        elif isinstance(value, list):
            flags += [flag, *map(str, value)]
        else:
            flags += [flag, str(value)]
    return flags


def replica_name(kind: str, index: int, num_replicas: int) -> str:
    """`scheduler` with one replica; `scheduler-0`, `scheduler-1`, ... with several."""
    return kind if num_replicas == 1 else f"{kind}-{index}"


# The small services (gateway, tokenizer, scheduler, kv-cache-manager) each get one
# OpenMP/MKL/tokenizers thread: their work is light, and idle pool threads spinning
# on a small machine take cores from the gpu-worker, which keeps torch's default.
LIGHT_SERVICE_THREADS_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                             "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def worker_load_env(other_services: int, workers: int) -> dict[str, str]:
    """The gpu-workers' PAGODA_LOAD_THREADS (pagoda.worker.load_threads): the cores the
    `other_services` starting beside them leave, shared among the `workers` (at least
    one each); nothing when the operator set the variable."""
    if os.environ.get("PAGODA_LOAD_THREADS"):
        return {}
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return {"PAGODA_LOAD_THREADS": str(max(1, (cores - other_services) // max(workers, 1)))}


def build_services(args: argparse.Namespace, redis_url: str,
                   redis_password: str | None = None,
                   supervisor_metrics: str | None = None) -> list[ServiceProcess]:
    """The processes of the cluster: one kv-cache-manager and gateway,
    `--tokenizer-replicas` tokenizers, and
    `--data-parallel-size` model replicas (a scheduler and its gpu-worker each).
    `supervisor_metrics` (host:port): the supervisor's own /metrics, which the
    gateway's /metrics includes like a service's. Secrets (the API key, the Redis URL and password) reach them through their
    environment, never their command line."""
    loopback = "127.0.0.1"
    plans = plan_replicas(args)  # serve_roles.py: colocated, or prefill + decode
    replicas = [(p.scheduler, p.worker, p.index) for p in plans]
    tokenizers = [replica_name("tokenizer", i, args.tokenizer_replicas)
                  for i in range(args.tokenizer_replicas)]
    ports = {name: free_port() for name in (*tokenizers, "kv-cache-manager",
                                            *(n for r in replicas for n in r[:2]))}
    addr = {name: f"{loopback}:{port}" for name, port in ports.items()}
    metrics_addr = {name: f"{loopback}:{free_port()}" for name in ports}
    peer_metrics = {**metrics_addr,
                    **({"supervisor": supervisor_metrics} if supervisor_metrics else {})}
    observe = (["--otlp-traces-endpoint", args.otlp_traces_endpoint]
               if args.otlp_traces_endpoint else [])
    tls = GrpcTLS.from_args(args)
    observe += tls.flags() if tls is not None else []
    keepalive = Keepalive.from_args(args)
    observe += keepalive.flags() if keepalive != Keepalive() else []
    stats = ["--log-stats-interval", str(args.log_stats_interval),
             *(["--disable-log-stats"] if args.disable_log_stats else [])]
    model = args.model_tag or args.model
    model_flags = ["--model", model] if model else []
    names = ["--served-model-name", *args.served_model_name] if args.served_model_name else []
    engine = engine_flags(args)
    seed = (["--prefix-cache-hash-seed", args.prefix_cache_hash_seed]
            if "--prefix-cache-hash-seed" in engine else [])
    seed += (["--prefix-caching-hash-algo", args.prefix_caching_hash_algo]
             if "--prefix-caching-hash-algo" in engine else [])

    def cmd(kind: str, *extra: str) -> list[str]:
        return [sys.executable, "-m", "pagoda.services.cli.main", kind, *extra]

    # Every service starts at once: the workers' loads share the cores with the others'
    # start-ups (a worker gets torch's own thread count back once it has loaded).
    load_env = worker_load_env(len(tokenizers) + 2 + len(replicas), len(replicas))

    def grpc_service(kind: str, name: str, *extra: str, replica: int | None = None,
                     env: dict[str, str] | None = None) -> ServiceProcess:
        light = load_env if kind == "gpu-worker" else LIGHT_SERVICE_THREADS_ENV
        return ServiceProcess(name, cmd(kind, "--host", loopback, "--port", str(ports[name]),
                                        "--metrics-port", metrics_addr[name].split(":")[1],
                                        *observe, *extra), addr[name], kind=kind,
                              replica=replica, env={**light, **(env or {})})

    redis_env = {REDIS_URL_ENV: redis_url}
    if redis_password:
        redis_env[REDIS_PASSWORD_ENV] = redis_password
    gateway_env = {"PAGODA_API_KEY": args.api_key} if args.api_key else {}
    gateway_extra = (http_flags(args) + gateway_flags(args) + lora_flags(args)
                     + generate_read_flags(args) + prefix_pull_flags(args)
                     + api_server_flags(args)
                     + (["--limit-mm-per-prompt", args.limit_mm_per_prompt]
                        if args.limit_mm_per_prompt else []))
    services = [
        grpc_service("kv-cache-manager", "kv-cache-manager", env=redis_env),
    ] + [
        grpc_service("tokenizer", name, *model_flags, *seed, *hub_flags(args),
                     *(["--tokenizer", args.tokenizer] if args.tokenizer else []),
                     *(["--chat-template", args.chat_template] if args.chat_template else []),
                     *template_limit_flags(args), *media_flags(args))
        for name in tokenizers
    ]
    for plan in plans:
        scheduler, worker, i = plan.scheduler, plan.worker, plan.index
        services += [
            grpc_service("gpu-worker", worker, *model_flags, *engine, *plan.kv_flags,
                         replica=i),
            grpc_service("scheduler", scheduler, *model_flags, *engine, *names, *stats,
                         "--worker-addr", addr[worker],
                         "--kv-cache-manager-addr", addr["kv-cache-manager"],
                         "--drain-timeout", str(args.drain_timeout),
                         *_execute_model_timeout(args), *_kv_events_flags(args, i),
                         *plan.kv_flags, *scheduler_kv_flags(args), replica=i),
        ]
    services.append(ServiceProcess(
        "gateway", cmd("gateway", "--host", args.host, "--port", str(args.port),
                       "--tokenizer-addr", ",".join(addr[n] for n in tokenizers),
                       "--scheduler-addrs", ",".join(addr[r[0]] for r in replicas),
                       "--kv-cache-manager-addr", addr["kv-cache-manager"],
                       "--router", args.router,
                       *(["--kv-medium-weights", args.kv_medium_weights]
                         if args.kv_medium_weights else []),
                       "--peer-metrics", ",".join(f"{n}={a}" for n, a in peer_metrics.items()),
                       *observe, *names, *gateway_extra),
        f"{_connect_host(args.host)}:{args.port}", http_health=True,
        env={**LIGHT_SERVICE_THREADS_ENV, **gateway_env},
        http_ssl=_health_check_ssl(args)))
    return services


def run(args: argparse.Namespace) -> int:
    startup_clock.mark("imports")
    problem = _flag_problem(args)
    if problem:
        _say(f"error: {problem}")
        return 2
    try:  # a hub model: downloaded once here, not by each service at once
        # Every service started below inherits HF_HUB_OFFLINE=1: they read this cache.
        os.environ.update(prefetch_for_serve(args))
    except (OSError, ValueError) as exc:
        _say(f"error: {exc}")
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    redis, cluster = None, None
    if args.data_parallel_size < 1:
        _say(f"error: --data-parallel-size must be at least 1, got {args.data_parallel_size}")
        return 2
    if role_problem(args):
        _say(f"error: {role_problem(args)}")
        return 2
    if args.api_server_count < 1:
        _say(f"error: --api-server-count must be at least 1, got {args.api_server_count}")
        return 2
    if args.tokenizer_replicas < 1:
        _say(f"error: --tokenizer-replicas must be at least 1, got {args.tokenizer_replicas}")
        return 2
    try:
        parse_kv_events_config(args.kv_events_config)
    except ValueError as exc:
        _say(f"error: {exc}")
        return 2
    if restart_policy(args).problem():
        _say(f"error: {restart_policy(args).problem()}")
        return 2
    try:
        configure_grpc_tls(args)  # the supervisor's health checks speak it too
        redis_url, redis_password = args.redis_url, os.environ.get(REDIS_PASSWORD_ENV)
        if not redis_url:
            # A supervised service like the others (restarted after it dies, counted in
            # pagoda_service_restarts_total{service="redis"}): nothing waits on it for a
            # request, and the index refills from the schedulers' snapshots.
            redis_password = secrets.token_urlsafe(24)
            redis = PrivateRedis(password=redis_password)
            redis_url = redis.url
            _say(f"starting a private Redis at {redis_url} (password protected, supervised)")
        # Bound before the services start (port 0: no race for it); serves only the
        # restart counter, which the gateway's /metrics then includes.
        supervisor_metrics = MetricsServer("127.0.0.1", 0, lambda: True)
        services = build_services(args, redis_url, redis_password,
                                  f"127.0.0.1:{supervisor_metrics.port}")
        if redis is not None:
            services.insert(0, ServiceProcess("redis", redis.supervised_command(),
                                              f"{redis.host}:{redis.port}",
                                              health_check=redis.ping))
        cluster = LocalCluster(services, restart_policy=restart_policy(args))
        supervisor_metrics.registry = cluster.metrics.registry
        supervisor_metrics.start()
        startup_clock.mark("checks and Redis")
        cluster.start()
        startup_clock.mark("spawning services")
        _say(startup_clock.line("services started"))
        cluster.wait_healthy(args.startup_timeout, stop)
        scheme = "https" if args.ssl_certfile else "http"
        print(f"Pagoda is serving the OpenAI API at {scheme}://{_connect_host(args.host)}:"
              f"{args.port}/v1 (Ctrl-C to stop)", flush=True)
        failure = cluster.watch(stop)
        if failure is not None:
            raise failure
        return 0
    except (ServiceFailed, TimeoutError, RuntimeError, SystemExit) as exc:
        _say(f"error: {exc}")
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        _say("stopping")
        if cluster is not None:
            cluster.stop()
        if redis is not None:
            redis.cleanup()  # its process is one of the cluster's, stopped above


def _flag_problem(args: argparse.Namespace) -> str | None:
    """What makes the flags unservable, found before anything starts."""
    if args.trust_remote_code:
        return TRUST_REMOTE_CODE_REFUSED
    try:
        uvicorn_kwargs(args)
        load_chat_template(args.chat_template)
        StructuredOutputsConfig.parse(args.structured_outputs_config, args.reasoning_parser)
        ReasoningConfig.parse(args.reasoning_config)
        if args.kv_medium_weights:
            parse_medium_weights(args.kv_medium_weights)
        ServingOptions(enable_auto_tool_choice=args.enable_auto_tool_choice,
                       tool_call_parser=args.tool_call_parser,
                       reasoning_parser=args.reasoning_parser).check_parsers()
    except ValueError as exc:
        return str(exc)
    return None


def _health_check_ssl(args: argparse.Namespace) -> ssl.SSLContext | None:
    """The supervisor's TLS for the gateway's /health: loopback, so the certificate is
    not verified; it presents the gateway's own certificate if clients must have one."""
    if not args.ssl_certfile:
        return None
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    if args.ssl_cert_reqs == ssl.CERT_REQUIRED:
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
    return context


def api_server_flags(args: argparse.Namespace) -> list[str]:
    """--api-server-count and its pid file, for the gateway (nothing at the default)."""
    if args.api_server_count == 1:
        return []
    pid_file = ["--api-server-pid-file", args.api_server_pid_file] \
        if args.api_server_pid_file else []
    return ["--api-server-count", str(args.api_server_count), *pid_file]


def _kv_events_flags(args: argparse.Namespace, replica: int) -> list[str]:
    config = parse_kv_events_config(args.kv_events_config)
    return [] if config is None else ["--kv-events-config",
                                      config.with_port_offset(replica).to_json()]


def _execute_model_timeout(args: argparse.Namespace) -> list[str]:
    value = args.execute_model_timeout
    return [] if value is None else ["--execute-model-timeout", f"{value:g}"]


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else ("[::1]" if host == "::" else host)


def _say(message: str) -> None:
    print(f"pagoda serve: {message}", file=sys.stderr, flush=True)
