"""`pagoda <command>`: one console script for every service, the local cluster and benchmarks.

Commands are registered by module: each module in `COMMAND_MODULES` (and each in
`BENCH_MODULES`, under `pagoda bench`) defines ``add_parser(subparsers)``, which
adds its subcommand(s) and sets ``func`` (``args -> exit code``). Adding a command
is one line here. Modules are imported only to build the parser; heavy imports
(torch, transformers) happen inside ``func``. Every command takes `--config
FILE.yaml` and lists the environment variables in its `--help` (arg_parser.py).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from pagoda.envs import environment_help
from pagoda.services.cli import services
from pagoda.services.cli.arg_parser import PagodaArgumentParser
import pagoda

COMMAND_MODULES = {  # command -> the module whose add_parser adds it
    "serve": "pagoda.services.cli.serve",
    "chat": "pagoda.services.cli.chat",
    "complete": "pagoda.services.cli.complete",
    "run-batch": "pagoda.services.cli.run_batch",
    "collect-env": "pagoda.services.cli.collect_env",
    "download": "pagoda.services.cli.download",
}
# pagoda gateway | tokenizer | scheduler | gpu-worker | kv-cache-manager | epp
SERVICES_MODULE = "pagoda.services.cli.services"
BENCH_MODULES = [
    "pagoda.bench.throughput",  # pagoda bench throughput
    "pagoda.bench.latency",     # pagoda bench latency
    "pagoda.bench.mm_processor",  # pagoda bench mm-processor
    "pagoda.services.bench.serve",       # pagoda bench serve
    "pagoda.services.bench.routing",     # pagoda bench routing
    "pagoda.services.bench.control_plane",  # pagoda bench control-plane
    "pagoda.services.bench.startup",     # pagoda bench startup
]


def build_parser(service: str | None = None) -> argparse.ArgumentParser:
    """Every command's parser; with `service` (a service of `services.SERVICES` or a
    command of `COMMAND_MODULES`), a parser holding only that command, so that a process
    imports its own module and not every other's: a tokenizer or scheduler then never
    imports torch or fastapi, and `pagoda serve` does not import the gpu-worker's torch
    before it spawns the services (seconds of CPU per process at a cluster's start, on
    the start-up's critical path for `pagoda serve`)."""
    parser = PagodaArgumentParser(prog="pagoda", description="Pagoda LLM inference engine.")
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    if service in services.SERVICES:
        services.add_parser(commands, only=service)
    elif service in COMMAND_MODULES:
        importlib.import_module(COMMAND_MODULES[service]).add_parser(commands)
    else:
        _add_every_command(commands)
    for command in _leaf_commands(parser):
        command.add_config_option()
        command.epilog = environment_help()
    return parser


def _add_every_command(commands) -> None:
    for name in (*COMMAND_MODULES.values(), SERVICES_MODULE):
        importlib.import_module(name).add_parser(commands)
    bench = commands.add_parser("bench", help="Benchmarks (offline engine, served cluster).")
    bench_commands = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    for name in BENCH_MODULES:
        importlib.import_module(name).add_parser(bench_commands)


def _service_command(argv: list[str]) -> str | None:
    """The service or command `argv` runs (`pagoda tokenizer --port ...`, `pagoda serve`)
    when one module alone adds it, else None (`pagoda bench ...`, `pagoda --help`)."""
    first = next((a for a in argv if not a.startswith("-")), None)
    return first if first in services.SERVICES or first in COMMAND_MODULES else None


def _leaf_commands(parser: argparse.ArgumentParser) -> list[PagodaArgumentParser]:
    """Every parser that runs a command (not one that only holds subcommands)."""
    groups = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not groups:
        return [parser]
    children = dict.fromkeys(p for g in groups for p in g.choices.values())  # aliases once
    return [leaf for child in children for leaf in _leaf_commands(child)]


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    try:
        parser = build_parser(_service_command(argv))
    except ValueError as exc:  # an environment variable that does not parse (pagoda.envs)
        print(f"pagoda: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


def _version() -> str:
    return f"pagoda {pagoda.__version__}"


if __name__ == "__main__":
    sys.exit(main())
