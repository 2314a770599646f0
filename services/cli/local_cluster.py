"""Run the five services as local processes on loopback and supervise them.

`pagoda serve` uses it; so do the end-to-end tests. Invariants:
  * each service is its own process (own session, so Ctrl-C reaches only the
    supervisor, which then stops them gateway-first) and gets SIGTERM when the
    supervisor dies, even if it is killed (the child sets PR_SET_PDEATHSIG itself:
    no code runs between fork and exec in a supervisor with gRPC threads, see
    `pagoda.parent_death`);
  * the cluster is "up" only when every service answers its health check; a service
    that exits before then is a start-up failure (ServiceFailed at once: a bad flag
    is not retried);
  * once up, a service that exits is restarted under the RestartPolicy
    (supervision.py: its own command line, backoff, a limit per window; a model
    replica restarts as a unit). `watch()` returns the service only when it crash-
    loops (or at once with the default policy, which restarts nothing) -- unless it
    belongs to one of several model replicas: then that replica is retired, and the
    cluster goes on with the remaining ones. Each service's last log lines are kept
    for the message.
"""

from __future__ import annotations

import collections
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagoda.parent_death import dying_with_this_process
from pagoda.services.cli.supervision import RestartLedger, RestartMetrics, RestartPolicy
from pagoda.services.common import grpc_channels

# Start order; shutdown goes the other way (the gateway stops taking requests first).
SERVICE_ORDER = ["redis", "kv-cache-manager", "tokenizer", "gpu-worker", "scheduler", "gateway",
                 "epp"]
LOG_TAIL_LINES = 40
STOP_GRACE_S = 5.0  # a restart unit's surviving members get this long after SIGTERM


@dataclass
class ServiceProcess:
    """One child process, its address and the tail of its stderr."""

    name: str
    argv: list[str]
    address: str  # host:port
    http_health: bool = False  # gateway: GET /health; others: gRPC health
    health_check: Callable[[], bool] | None = None  # neither (the private Redis: PING)
    # The gateway serves HTTPS (--ssl-certfile): the health check's TLS context.
    http_ssl: ssl.SSLContext | None = None
    kind: str = ""  # the command (SERVICE_ORDER); defaults to the name
    replica: int | None = None  # which model replica a scheduler/gpu-worker belongs to
    env: dict[str, str] = field(default_factory=dict)  # secrets go here, never in argv
    process: subprocess.Popen | None = None
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=LOG_TAIL_LINES))

    def __post_init__(self) -> None:
        self.kind = self.kind or self.name

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def is_healthy(self) -> bool:
        if self.health_check is not None:
            return self.health_check()
        if self.http_health:
            scheme = "https" if self.http_ssl is not None else "http"
            try:
                # Plain HTTP verifies nothing: verify=False spares each poll the default
                # context's CA bundle load (~30 ms of CPU a call, 4 calls a second
                # through a cluster's start, on the cores the services start on).
                return httpx.get(f"{scheme}://{self.address}/health", timeout=2.0,
                                 verify=self.http_ssl if self.http_ssl is not None
                                 else False).status_code == 200
            except httpx.HTTPError:
                return False
        with grpc_channels.channel(self.address) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=2.0)
            except grpc.RpcError:
                return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING


class ServiceFailed(RuntimeError):
    """A service exited; the message names it and quotes its last log lines."""

    def __init__(self, service: ServiceProcess, restarts: int = 0, window_s: float = 0.0
                 ) -> None:
        code = service.process.returncode if service.process else None
        lines = "".join(f"    {line}" for line in service.tail)
        loop = (f" after {restarts} restart(s) in {window_s:g} s: a crash loop" if restarts
                else "")
        super().__init__(f"service '{service.name}' exited with code {code}{loop}; its last "
                         f"log lines:\n{lines}")
        self.service = service
        self.restarts = restarts


class LocalCluster:
    """Start, watch and stop a set of ServiceProcess."""

    def __init__(self, services: list[ServiceProcess], log_stream=None,
                 restart_policy: RestartPolicy | None = None) -> None:
        self.services = {s.name: s for s in services}
        self.retired: list[ServiceProcess] = []  # replicas dropped by watch(), reaped by stop()
        self.log_stream = log_stream if log_stream is not None else sys.stderr
        self._log_lock = threading.Lock()
        self.policy = restart_policy or RestartPolicy()
        self.metrics = RestartMetrics([s.name for s in services])
        self._ledgers: dict[str, RestartLedger] = {}  # by restart unit
        # Units going down for a restart: (when to start again, when to SIGKILL stragglers).
        self._restarting: dict[str, tuple[float, float]] = {}

    def ordered(self) -> list[ServiceProcess]:
        """Services in start order (by kind, then name)."""
        return sorted(self.services.values(),
                      key=lambda s: (SERVICE_ORDER.index(s.kind), s.name))

    def start(self) -> None:
        for service in self.ordered():
            self._spawn(service)

    def restart(self, name: str) -> None:
        """Start an exited service again with the same command line (tests)."""
        self._spawn(self.services[name])

    def _spawn(self, service: ServiceProcess) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **service.env)
        service.process = subprocess.Popen(
            dying_with_this_process(service.argv, signal.SIGTERM), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, start_new_session=True)
        threading.Thread(target=self._pump, args=(service,), daemon=True,
                         name=f"log-{service.name}").start()

    def _pump(self, service: ServiceProcess) -> None:
        """Copy a child's stderr to ours, prefixed, keeping the tail for errors."""
        for raw in service.process.stderr:
            line = raw.decode(errors="replace")
            service.tail.append(line)
            with self._log_lock:
                self.log_stream.write(f"[{service.name}] {line}")
                self.log_stream.flush()

    def failed_service(self) -> ServiceProcess | None:
        for service in self.services.values():
            if service.process is not None and service.process.poll() is not None:
                return service
        return None

    def wait_healthy(self, timeout: float, stop: threading.Event | None = None) -> None:
        """Return once every service is healthy; raise ServiceFailed or TimeoutError."""
        deadline = time.monotonic() + timeout
        pending = self.ordered()
        while pending:
            failed = self.failed_service()
            if failed is not None:
                raise ServiceFailed(failed)
            if stop is not None and stop.is_set():
                raise KeyboardInterrupt
            pending = [s for s in pending if not s.is_healthy()]
            if pending and time.monotonic() > deadline:
                names = ", ".join(s.name for s in pending)
                raise TimeoutError(f"services not healthy after {timeout:.0f}s: {names}")
            if pending:
                time.sleep(0.25)

    def watch(self, stop: threading.Event, poll: float = 0.2) -> ServiceFailed | None:
        """Block until `stop` is set (-> None) or a service crash-loops (-> ServiceFailed
        naming it), restarting services that exit and outliving the loss of model
        replicas while at least one remains."""
        while not stop.wait(poll):
            now = time.monotonic()
            for service in self._newly_exited():
                failure = self._on_exit(service, now)
                if failure is not None:
                    return failure
            self._advance_restarts(now)
        return None

    @staticmethod
    def unit_of(service: ServiceProcess) -> str:
        """What restarts together: a model replica, else the service alone."""
        return f"replica {service.replica}" if service.replica is not None else service.name

    def _members(self, unit: str) -> list[ServiceProcess]:
        return [s for s in self.ordered() if self.unit_of(s) == unit]

    def _newly_exited(self) -> list[ServiceProcess]:
        return [s for s in self.ordered() if s.process is not None
                and s.process.poll() is not None and self.unit_of(s) not in self._restarting]

    def _on_exit(self, failed: ServiceProcess, now: float) -> ServiceFailed | None:
        """Schedule `failed`'s unit for a restart, or report a crash loop."""
        unit = self.unit_of(failed)
        ledger = self._ledgers.setdefault(unit, RestartLedger(self.policy))
        delay = ledger.next_delay(now)
        code = failed.process.returncode
        if delay is None:
            if self._drop_replica(failed):
                return None
            return ServiceFailed(failed, ledger.recent, self.policy.window_s)
        members = self._members(unit)
        for member in members:
            if member.process.poll() is None:
                member.process.send_signal(signal.SIGTERM)
        self._say(f"service '{failed.name}' exited with code {code}: restarting "
                  f"{' and '.join(m.name for m in members)} in {delay:g} s (restart "
                  f"{ledger.recent} of at most {self.policy.max_restarts} in "
                  f"{self.policy.window_s:g} s)")
        self._restarting[unit] = (now + delay, now + STOP_GRACE_S)
        return None

    def _advance_restarts(self, now: float) -> None:
        """Start each unit again once all its processes are gone and its delay passed."""
        for unit, (start_at, kill_at) in list(self._restarting.items()):
            members = self._members(unit)
            alive = [m for m in members if m.process.poll() is None]
            if alive and now >= kill_at:
                for member in alive:
                    member.process.kill()
            if alive or now < start_at:
                continue
            for member in members:  # start order: a replica's worker before its scheduler
                member.tail.append("--- restarted by pagoda serve ---\n")
                # counted first: whoever sees the new process also sees it counted
                self.metrics.restarts.labels(member.name).inc()
                self._spawn(member)
            del self._restarting[unit]
            self._say(f"restarted {', '.join(m.name for m in members)}")

    def _say(self, message: str) -> None:
        with self._log_lock:
            self.log_stream.write(f"[pagoda serve] {message}\n")
            self.log_stream.flush()

    def _drop_replica(self, failed: ServiceProcess) -> bool:
        """Retire the replica `failed` belongs to, if another one serves on."""
        replicas = {s.replica for s in self.services.values() if s.replica is not None}
        if failed.replica is None or len(replicas) < 2:
            return False
        retired = [s for s in self.services.values() if s.replica == failed.replica]
        for service in retired:
            del self.services[service.name]
            self.retired.append(service)
            if service.process is not None and service.process.poll() is None:
                service.process.send_signal(signal.SIGTERM)
        self._say(f"{failed.name} exited with code {failed.process.returncode}: replica "
                  f"{failed.replica} retired, {len(replicas) - 1} replica(s) serve on")
        return True

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the services in reverse start order; SIGKILL what is still alive at the
        deadline. The gateway goes first and the schedulers next, each waited for (a
        third of `timeout` at most): in-flight HTTP requests end, then the schedulers
        drain and deregister from the kv-cache-manager while it still runs."""
        order = list(reversed(self.ordered())) + self.retired
        for kind in ("gateway", "scheduler", None):
            group = [s for s in order if kind is None or s.kind == kind]
            for service in group:
                if service.process is not None and service.process.poll() is None:
                    service.process.send_signal(signal.SIGTERM)
            if kind is not None:
                deadline = time.monotonic() + timeout / 3
                for service in group:
                    if service.process is not None:
                        _wait(service.process, max(0.0, deadline - time.monotonic()))
        deadline = time.monotonic() + timeout
        for service in order:
            if service.process is not None:
                _wait(service.process, max(0.1, deadline - time.monotonic()))
                if service.process.poll() is None:
                    service.process.kill()
                    service.process.wait()


def _wait(process: subprocess.Popen, timeout: float) -> None:
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        pass
