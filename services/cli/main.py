"""`pagoda <command>`: one console script for every service, the local cluster and benchmarks.

Commands are registered by module: each module in `COMMAND_MODULES` (and each in
`BENCH_MODULES`, under `pagoda bench`) defines ``add_parser(subparsers)``, which
adds its subcommand(s) and sets ``func`` (``args -> exit code``). Adding a command
is one line here. Modules are imported only to build the parser; heavy imports
(torch, transformers) happen inside ``func``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = [
    "pagoda.services.cli.serve",      # pagoda serve
    "pagoda.services.cli.services",   # pagoda gateway | tokenizer | scheduler | gpu-worker | kv-cache-manager
    "pagoda.services.cli.chat",       # pagoda chat
    "pagoda.services.cli.complete",   # pagoda complete
]
BENCH_MODULES = [
    "pagoda.bench.throughput",  # pagoda bench throughput
    "pagoda.services.bench.serve",       # pagoda bench serve
    "pagoda.services.bench.routing",     # pagoda bench routing
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description="Pagoda LLM inference engine.")
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(commands)
    bench = commands.add_parser("bench", help="Benchmarks (offline engine, served cluster).")
    bench_commands = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    for name in BENCH_MODULES:
        importlib.import_module(name).add_parser(bench_commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


def _version() -> str:
    import pagoda

    return f"pagoda {pagoda.__version__}"


if __name__ == "__main__":
    sys.exit(main())
