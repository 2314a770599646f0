"""The `pagoda` command line: every command is there with the flags the chart relies on."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from pagoda.services.cli.main import build_parser
from pagoda.services.cli.serve import build_services, engine_flags

CONTRACT = {
    "gateway": ["--host", "--port", "--tokenizer-addr", "--scheduler-addrs",
                "--kv-cache-manager-addr", "--served-model-name", "--api-key"],
    "tokenizer": ["--host", "--port", "--metrics-port", "--model"],
    "scheduler": ["--host", "--port", "--metrics-port", "--model", "--worker-addr",
                  "--kv-cache-manager-addr", "--max-model-len", "--enable-prefix-caching"],
    "gpu-worker": ["--host", "--port", "--metrics-port", "--model", "--dtype"],
    "kv-cache-manager": ["--host", "--port", "--metrics-port", "--redis-url"],
    "serve": ["--host", "--port", "--served-model-name", "--max-model-len", "--dtype",
              "--enable-prefix-caching", "--max-num-seqs", "--max-num-batched-tokens",
              "--redis-url"],
}
DEFAULT_PORTS = {"gateway": 8000, "tokenizer": 50051, "scheduler": 50052, "gpu-worker": 50053,
                 "kv-cache-manager": 50054}


def subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[name]


@pytest.mark.parametrize("command", sorted(CONTRACT))
def test_each_command_has_its_contract_flags(command):
    options = {o for a in subparser(command)._actions for o in a.option_strings}
    assert set(CONTRACT[command]) <= options


@pytest.mark.parametrize("command,port", sorted(DEFAULT_PORTS.items()))
def test_default_ports(command, port):
    assert subparser(command).parse_args([]).port == port


def test_bench_has_serve_and_throughput():
    bench = subparser("bench")
    commands = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction))
    assert {"serve", "throughput"} <= set(commands.choices)
    args = commands.choices["serve"].parse_args(
        ["--base-url", "http://x:1", "--num-prompts", "3", "--max-concurrency", "2",
         "--random-input-len", "5", "--random-output-len", "6"])
    assert (args.num_prompts, args.max_concurrency, args.random_input_len,
            args.random_output_len) == (3, 2, 5, 6)


def test_help_runs_as_a_console_script():
    out = subprocess.run([sys.executable, "-m", "pagoda.services.cli.main", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0
    for command in [*DEFAULT_PORTS, "serve", "bench"]:
        assert command in out.stdout


def test_serve_passes_only_the_engine_flags_the_user_set():
    args = subparser("serve").parse_args(
        ["/models/m", "--max-model-len", "512", "--no-enable-prefix-caching", "--enforce-eager",
         "--max-num-seqs", "8", "--served-model-name", "a", "b"])
    flags = engine_flags(args)
    assert sorted(flags) == sorted(["--max-model-len", "512", "--no-enable-prefix-caching",
                                    "--max-num-seqs", "8", "--enforce-eager"])
    assert flags[flags.index("--max-model-len") + 1] == "512"
    services = {s.name: s for s in build_services(args, "redis://127.0.0.1:1/0")}
    worker, scheduler = services["gpu-worker"].argv, services["scheduler"].argv
    assert worker[worker.index("--model") + 1] == "/models/m"
    assert "--no-enable-prefix-caching" in scheduler and "--max-num-seqs" in worker
    gateway = services["gateway"].argv
    assert gateway[gateway.index("--served-model-name") + 1:][:2] == ["a", "b"]
    assert gateway[gateway.index("--scheduler-addrs") + 1] == services["scheduler"].address
    # The Redis URL (it may carry a password) travels in the environment, not argv.
    manager = services["kv-cache-manager"]
    assert manager.env["PAGODA_REDIS_URL"] == "redis://127.0.0.1:1/0"
    assert not any("redis://" in arg for arg in manager.argv)


def test_serve_gives_the_worker_the_cores_and_the_small_services_one_thread():
    args = subparser("serve").parse_args(["/models/m", "--batch-invariant"])
    services = {s.name: s for s in build_services(args, "redis://127.0.0.1:1/0")}
    assert "OMP_NUM_THREADS" not in services["gpu-worker"].env
    for name in ("gateway", "tokenizer-0", "tokenizer-1", "scheduler", "kv-cache-manager"):
        assert services[name].env["OMP_NUM_THREADS"] == "1", name
    assert "--batch-invariant" in services["gpu-worker"].argv  # reaches the worker's engine


def test_serve_loads_the_workers_with_the_cores_the_others_leave(monkeypatch):
    """Every service starts at once: the workers' loads get the cores the six others
    (two tokenizers, two schedulers, kv-cache-manager, gateway) leave, at least one,
    shared among the workers; an operator's PAGODA_LOAD_THREADS is left alone."""
    monkeypatch.delenv("PAGODA_LOAD_THREADS", raising=False)
    args = subparser("serve").parse_args(["/models/m", "--data-parallel-size", "2"])
    for cores, each in ((2, "1"), (8, "1"), (15, "4"), (64, "29")):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cores: set(range(n)))
        services = build_services(args, "redis://127.0.0.1:1/0")
        workers = [s for s in services if s.kind == "gpu-worker"]
        assert len(workers) == 2
        assert all(w.env["PAGODA_LOAD_THREADS"] == each for w in workers), cores
        assert all("PAGODA_LOAD_THREADS" not in s.env for s in services
                   if s.kind != "gpu-worker")
    monkeypatch.setenv("PAGODA_LOAD_THREADS", "3")
    assert all("PAGODA_LOAD_THREADS" not in s.env
               for s in build_services(args, "redis://127.0.0.1:1/0"))


@pytest.mark.parametrize("service", ["gateway", "tokenizer", "scheduler", "kv-cache-manager",
                                     "serve"])
def test_a_service_process_parses_its_flags_without_torch(service):
    """Each service of a cluster is its own process: building its parser must not import
    every other service's module (torch alone is seconds of CPU per process at start).
    `pagoda serve` neither: its imports come before it spawns any service, so they are on
    the critical path of the cluster's start-up."""
    code = ("import sys; from pagoda.services.cli.main import build_parser, _service_command; "
            f"p = build_parser(_service_command(['{service}', '--port', '1'])); "
            f"p.parse_args(['{service}', '--port', '1']); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stderr[-2000:]
