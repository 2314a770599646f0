"""The local cluster's supervisor restarts what exits, like a pod controller: the same
command line, backoff, a limit per window, a model replica as one unit, and a crash
loop reported with the service's name and last log lines."""

from __future__ import annotations

import io
import signal
import sys
import threading
import time

from prometheus_client import generate_latest

from pagoda.services.cli.local_cluster import LocalCluster, ServiceProcess
from pagoda.services.cli.supervision import RestartLedger, RestartPolicy

SLEEPER = "import sys, time; print('hello from', sys.argv[1], file=sys.stderr); time.sleep(60)"


def _sleeper(name: str, kind: str, replica: int | None = None) -> ServiceProcess:
    return ServiceProcess(name, [sys.executable, "-c", SLEEPER, name], "127.0.0.1:1",
                          kind=kind, replica=replica)


def _wait_new_pid(service: ServiceProcess, old: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if service.pid != old and service.process.poll() is None:
            return service.pid
        time.sleep(0.02)
    raise AssertionError(f"{service.name} was not restarted")


def _wait_greeting(service: ServiceProcess, timeout: float = 10.0) -> None:
    """Until this run of `service` has printed its greeting (the newest line of its log
    tail: after a restart, the marker comes first), however loaded the machine."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if service.tail and "hello from" in service.tail[-1]:
            return
        time.sleep(0.02)
    raise AssertionError(f"{service.name} printed no greeting: {list(service.tail)}")


def _restarts(cluster: LocalCluster, name: str) -> float:
    return cluster.metrics.registry.get_sample_value("pagoda_service_restarts_total",
                                                     {"service": name})


class Watched:
    def __init__(self, services: list[ServiceProcess], policy: RestartPolicy) -> None:
        self.log = io.StringIO()
        self.cluster = LocalCluster(services, log_stream=self.log, restart_policy=policy)
        self.by_name = {s.name: s for s in services}
        self.stop = threading.Event()
        self.outcome: list = []
        self.cluster.start()
        self.thread = threading.Thread(
            target=lambda: self.outcome.append(self.cluster.watch(self.stop, poll=0.02)))
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.cluster.stop(timeout=5)
        assert all(s.process.poll() is not None for s in self.by_name.values())


def test_the_ledger_backs_off_and_forgets_restarts_older_than_the_window():
    ledger = RestartLedger(RestartPolicy(max_restarts=3, window_s=10, backoff_s=1))
    assert [ledger.next_delay(t) for t in (0, 1, 2)] == [1, 2, 4]
    assert ledger.next_delay(3) is None  # a 4th within 10 s: crash loop
    assert ledger.next_delay(10.5) == 4  # the first fell out of the window


def test_a_killed_service_restarts_with_its_command_line_and_is_counted():
    tokenizer = _sleeper("tokenizer", "tokenizer")
    watched = Watched([_sleeper("gateway", "gateway"), tokenizer],
                      RestartPolicy(max_restarts=5, backoff_s=0.05))
    try:
        assert _restarts(watched.cluster, "tokenizer") == 0  # exported from start-up
        assert _restarts(watched.cluster, "gateway") == 0
        old = tokenizer.pid
        gateway_pid = watched.by_name["gateway"].pid
        tokenizer.process.send_signal(signal.SIGKILL)
        _wait_new_pid(tokenizer, old)
        assert tokenizer.argv == watched.by_name["tokenizer"].argv
        assert _restarts(watched.cluster, "tokenizer") == 1
        assert watched.by_name["gateway"].pid == gateway_pid  # nobody else was touched
        assert watched.thread.is_alive()
        assert "service 'tokenizer' exited with code -9: restarting" in watched.log.getvalue()
        text = generate_latest(watched.cluster.metrics.registry).decode()
        assert 'pagoda_service_restarts_total{service="tokenizer"} 1.0' in text
    finally:
        watched.close()


def test_a_replica_restarts_as_a_unit():
    services = [_sleeper("gateway", "gateway"), _sleeper("gpu-worker", "gpu-worker", 0),
                _sleeper("scheduler", "scheduler", 0)]
    watched = Watched(services, RestartPolicy(max_restarts=5, backoff_s=0.05))
    try:
        worker, scheduler = watched.by_name["gpu-worker"], watched.by_name["scheduler"]
        old_worker, old_scheduler = worker.pid, scheduler.pid
        worker.process.send_signal(signal.SIGKILL)
        _wait_new_pid(worker, old_worker)
        _wait_new_pid(scheduler, old_scheduler)  # its failed engine is not reused
        assert _restarts(watched.cluster, "gpu-worker") == 1
        assert _restarts(watched.cluster, "scheduler") == 1
    finally:
        watched.close()


def test_a_crash_loop_ends_the_watch_naming_the_service_and_its_last_lines():
    tokenizer = _sleeper("tokenizer", "tokenizer")
    watched = Watched([_sleeper("gateway", "gateway"), tokenizer],
                      RestartPolicy(max_restarts=2, window_s=60, backoff_s=0.05))
    try:
        for _ in range(2):
            old = tokenizer.pid
            _wait_greeting(tokenizer)  # its greeting reaches the log tail
            tokenizer.process.send_signal(signal.SIGKILL)
            _wait_new_pid(tokenizer, old)
        _wait_greeting(tokenizer)
        tokenizer.process.send_signal(signal.SIGKILL)
        watched.thread.join(10)
        assert watched.outcome and watched.outcome[0] is not None
        message = str(watched.outcome[0])
        assert "service 'tokenizer' exited with code -9 after 2 restart(s)" in message
        assert "crash loop" in message and "hello from tokenizer" in message
    finally:
        watched.close()


def test_the_private_redis_restarts_on_its_port_with_its_password():
    """`pagoda serve`'s Redis is a supervised service: SIGKILLed, it comes back on the
    same port, behind the same password (which is on no command line), and is counted."""
    import redis

    from pagoda.services.common.redis_server import PrivateRedis

    private = PrivateRedis(password="pw-restart-7Qx")
    service = ServiceProcess("redis", private.supervised_command(),
                             f"{private.host}:{private.port}", health_check=private.ping)
    watched = Watched([service], RestartPolicy(max_restarts=5, backoff_s=0.05))
    try:
        watched.cluster.wait_healthy(30)
        assert "pw-restart-7Qx" not in " ".join(service.argv)
        old = service.pid
        service.process.send_signal(signal.SIGKILL)
        _wait_new_pid(service, old)
        watched.cluster.wait_healthy(30)
        assert redis.Redis.from_url(private.url, password="pw-restart-7Qx").ping()
        assert _restarts(watched.cluster, "redis") == 1
        with open(f"/proc/{service.pid}/cmdline", "rb") as cmdline:
            assert b"pw-restart-7Qx" not in cmdline.read()
    finally:
        watched.close()
        private.cleanup()


def test_the_gateway_health_poll_over_plain_http_loads_no_ca_bundle(monkeypatch):
    """The supervisor polls the gateway's /health 4 times a second through a cluster's
    start: over plain HTTP each poll must not build a verifying TLS context (its CA
    bundle load is ~30 ms of CPU, on the cores the services start on)."""
    import http.server
    import ssl

    loads = []
    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations",
                        lambda self, *a, **k: loads.append(a), raising=False)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        gateway = ServiceProcess("gateway", ["true"], f"127.0.0.1:{server.server_port}",
                                 http_health=True)
        assert gateway.is_healthy()
        assert not ServiceProcess("gateway", ["true"], "127.0.0.1:1",
                                  http_health=True).is_healthy()
    finally:
        server.shutdown()
        server.server_close()
    assert loads == []
