"""`pagoda serve --data-parallel-size N --router R`: the processes it starts, and how the
supervisor outlives a lost replica."""

from __future__ import annotations

import io
import signal
import sys
import threading

from pagoda.services.cli.local_cluster import LocalCluster, ServiceProcess
from pagoda.services.cli.main import build_parser
from pagoda.services.cli.serve import build_services


def serve_args(*argv: str):
    return build_parser().parse_args(["serve", "/models/m", *argv])


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_each_replica_is_a_scheduler_with_its_own_worker_behind_one_gateway():
    args = serve_args("--data-parallel-size", "3", "--router", "session",
                      "--prefix-cache-hash-seed", "s33d")
    services = {s.name: s for s in build_services(args, "redis://127.0.0.1:1/0")}
    assert sorted(services) == ["gateway", "gpu-worker-0", "gpu-worker-1", "gpu-worker-2",
                                "kv-cache-manager", "scheduler-0", "scheduler-1", "scheduler-2",
                                "tokenizer-0", "tokenizer-1"]
    for i in range(3):
        scheduler = services[f"scheduler-{i}"]
        assert flag(scheduler.argv, "--worker-addr") == services[f"gpu-worker-{i}"].address
        assert scheduler.kind == "scheduler" and scheduler.replica == i
        assert flag(scheduler.argv, "--prefix-cache-hash-seed") == "s33d"
    gateway = services["gateway"].argv
    assert flag(gateway, "--scheduler-addrs").split(",") == \
        [services[f"scheduler-{i}"].address for i in range(3)]
    assert flag(gateway, "--router") == "session"
    # The tokenizers hash blocks for the router: they must use the schedulers' seed.
    for name in ("tokenizer-0", "tokenizer-1"):
        assert flag(services[name].argv, "--prefix-cache-hash-seed") == "s33d"
    # The gateway balances over every tokenizer (two by default).
    assert flag(gateway, "--tokenizer-addr").split(",") == \
        [services["tokenizer-0"].address, services["tokenizer-1"].address]


def test_one_replica_keeps_the_plain_names_and_kv_aware_is_the_default():
    services = {s.name: s for s in build_services(serve_args("--tokenizer-replicas", "1"),
                                                  "redis://127.0.0.1:1/0")}
    assert {"scheduler", "gpu-worker", "tokenizer"} <= set(services)
    assert flag(services["gateway"].argv, "--tokenizer-addr") == services["tokenizer"].address
    assert flag(services["gateway"].argv, "--router") == "kv_aware"


def _sleeper(name: str, kind: str, replica: int | None) -> ServiceProcess:
    return ServiceProcess(name, [sys.executable, "-c", "import time; time.sleep(60)"],
                          "127.0.0.1:1", kind=kind, replica=replica)


def test_the_supervisor_retires_a_dead_replica_and_stops_when_none_is_left():
    """With restarts off (the default policy; `pagoda serve --max-restarts 0`), or once a
    replica crash-loops."""
    services = [_sleeper("gateway", "gateway", None)]
    for i in range(2):
        services += [_sleeper(f"gpu-worker-{i}", "gpu-worker", i),
                     _sleeper(f"scheduler-{i}", "scheduler", i)]
    log = io.StringIO()
    cluster = LocalCluster(services, log_stream=log)
    cluster.start()
    stop = threading.Event()
    outcome: list = []
    watcher = threading.Thread(target=lambda: outcome.append(cluster.watch(stop, poll=0.05)))
    watcher.start()
    try:
        by_name = {s.name: s for s in services}
        by_name["scheduler-1"].process.send_signal(signal.SIGKILL)
        assert by_name["gpu-worker-1"].process.wait(10) is not None  # its partner is stopped
        watcher.join(0.5)
        assert watcher.is_alive()  # replica 0 serves on
        assert "replica 1 retired" in log.getvalue()
        by_name["gpu-worker-0"].process.send_signal(signal.SIGKILL)
        watcher.join(10)
        assert outcome and outcome[0].service.name == "gpu-worker-0"  # the last: fatal
    finally:
        stop.set()
        cluster.stop(timeout=5)
    assert all(s.process.poll() is not None for s in services)
