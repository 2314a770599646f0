"""`pagoda serve [MODEL]`: the whole cluster on this machine, one process per service.

Starts a private Redis (unless `--redis-url`), the kv-cache-manager, tokenizer,
gpu-worker, scheduler and gateway on free loopback ports (the gateway on
`--host:--port`), waits until each is healthy, prints the URL, and stops them all
on Ctrl-C/SIGTERM. If a service dies it stops the rest and exits 1, naming it.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from pagoda.cli.local_cluster import LocalCluster, ServiceFailed, ServiceProcess, die_with_parent


def add_parser(subparsers) -> argparse.ArgumentParser:
    from pagoda.engine.arg_utils import EngineArgs

    parser = subparsers.add_parser(
        "serve", help="Run every service locally and serve the OpenAI API.",
        description=__doc__.split("\n\n")[0])
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="HF safetensors directory or GGUF file (default: SmolLM2-135M-Instruct).")
    parser.add_argument("--host", default="127.0.0.1", help="The gateway's listen address.")
    parser.add_argument("--port", type=int, default=8000, help="The gateway's HTTP port.")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="Names clients may use for the model.")
    parser.add_argument("--redis-url", default=None,
                        help="Redis for the prefix index (default: start a private one).")
    parser.add_argument("--api-key", default=os.environ.get("PAGODA_API_KEY"),
                        help="Require `Authorization: Bearer KEY` (default: $PAGODA_API_KEY).")
    parser.add_argument("--startup-timeout", type=float, default=900.0,
                        help="Seconds to wait for every service to become healthy.")
    group = parser.add_argument_group("engine (passed to the scheduler and the gpu-worker)")
    EngineArgs.add_cli_args(group)
    parser.set_defaults(func=run)
    return parser


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags the user set, re-rendered for the scheduler and the worker."""
    from pagoda.engine.arg_utils import EngineArgs

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


def build_services(args: argparse.Namespace, redis_url: str) -> list[ServiceProcess]:
    from pagoda.services.common.redis_server import free_port

    loopback = "127.0.0.1"
    ports = {name: free_port() for name in ("tokenizer", "scheduler", "gpu-worker",
                                            "kv-cache-manager")}
    addr = {name: f"{loopback}:{port}" for name, port in ports.items()}
    model = args.model_tag or args.model
    model_flags = ["--model", model] if model else []
    names = ["--served-model-name", *args.served_model_name] if args.served_model_name else []
    engine = engine_flags(args)

    def cmd(name: str, *extra: str) -> list[str]:
        return [sys.executable, "-m", "pagoda.cli.main", name, *extra]

    def grpc_service(name: str, *extra: str) -> ServiceProcess:
        return ServiceProcess(name, cmd(name, "--host", loopback, "--port", str(ports[name]),
                                        *extra), addr[name])

    gateway_extra = ["--api-key", args.api_key] if args.api_key else []
    return [
        grpc_service("kv-cache-manager", "--redis-url", redis_url),
        grpc_service("tokenizer", *model_flags,
                     *(["--tokenizer", args.tokenizer] if args.tokenizer else [])),
        grpc_service("gpu-worker", *model_flags, *engine),
        grpc_service("scheduler", *model_flags, *engine, *names,
                     "--worker-addr", addr["gpu-worker"],
                     "--kv-cache-manager-addr", addr["kv-cache-manager"]),
        ServiceProcess("gateway", cmd("gateway", "--host", args.host, "--port", str(args.port),
                                      "--tokenizer-addr", addr["tokenizer"],
                                      "--scheduler-addrs", addr["scheduler"],
                                      "--kv-cache-manager-addr", addr["kv-cache-manager"],
                                      *names, *gateway_extra),
                       f"{_connect_host(args.host)}:{args.port}", http_health=True),
    ]


def run(args: argparse.Namespace) -> int:
    from pagoda.services.common.redis_server import PrivateRedis

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    redis, cluster = None, None
    try:
        redis_url = args.redis_url
        if not redis_url:
            redis = PrivateRedis().start(start_new_session=True, preexec_fn=die_with_parent)
            redis_url = redis.url
            _say(f"started a private Redis at {redis_url}")
        cluster = LocalCluster(build_services(args, redis_url))
        cluster.start()
        cluster.wait_healthy(args.startup_timeout, stop)
        print(f"Pagoda is serving the OpenAI API at http://{_connect_host(args.host)}:"
              f"{args.port}/v1 (Ctrl-C to stop)", flush=True)
        failed = cluster.watch(stop)
        if failed is not None:
            raise ServiceFailed(failed)
        return 0
    except (ServiceFailed, TimeoutError, RuntimeError) as exc:
        _say(f"error: {exc}")
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        _say("stopping")
        if cluster is not None:
            cluster.stop()
        if redis is not None:
            redis.stop()


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else ("[::1]" if host == "::" else host)


def _say(message: str) -> None:
    print(f"pagoda serve: {message}", file=sys.stderr, flush=True)
