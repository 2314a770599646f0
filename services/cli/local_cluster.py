"""Run the five services as local processes on loopback and supervise them.

`pagoda serve` uses it; so do the end-to-end tests. Invariants:
  * each service is its own process (own session, so Ctrl-C reaches only the
    supervisor, which then stops them gateway-first) and gets SIGTERM when the
    supervisor dies, even if it is killed (the child sets PR_SET_PDEATHSIG itself:
    no code runs between fork and exec in a supervisor with gRPC threads, see
    `pagoda.parent_death`);
  * the cluster is "up" only when every service answers its health check;
  * if any service exits, `watch()` returns it (its name, exit code and last log
    lines go into ServiceFailed) -- unless it belongs to one of several model
    replicas: then that replica's other process is stopped too, and the cluster
    goes on with the remaining replicas.
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
from dataclasses import dataclass, field

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagoda.parent_death import dying_with_this_process
from pagoda.services.common import grpc_channels

# Start order; shutdown goes the other way (the gateway stops taking requests first).
SERVICE_ORDER = ["kv-cache-manager", "tokenizer", "gpu-worker", "scheduler", "gateway"]
LOG_TAIL_LINES = 40


@dataclass
class ServiceProcess:
    """One child process, its address and the tail of its stderr."""

    name: str
    argv: list[str]
    address: str  # host:port
    http_health: bool = False  # gateway: GET /health; others: gRPC health
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
        if self.http_health:
            scheme = "https" if self.http_ssl is not None else "http"
            try:
                return httpx.get(f"{scheme}://{self.address}/health", timeout=2.0,
                                 verify=self.http_ssl or True).status_code == 200
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

    def __init__(self, service: ServiceProcess) -> None:
        code = service.process.returncode if service.process else None
        lines = "".join(f"    {line}" for line in service.tail)
        super().__init__(f"service '{service.name}' exited with code {code}; its last log "
                         f"lines:\n{lines}")
        self.service = service


class LocalCluster:
    """Start, watch and stop a set of ServiceProcess."""

    def __init__(self, services: list[ServiceProcess], log_stream=None) -> None:
        self.services = {s.name: s for s in services}
        self.retired: list[ServiceProcess] = []  # replicas dropped by watch(), reaped by stop()
        self.log_stream = log_stream if log_stream is not None else sys.stderr
        self._log_lock = threading.Lock()

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

    def watch(self, stop: threading.Event, poll: float = 0.2) -> ServiceProcess | None:
        """Block until `stop` is set (-> None) or a service exits (-> it), outliving
        the loss of model replicas while at least one remains."""
        while not stop.wait(poll):
            failed = self.failed_service()
            if failed is None:
                continue
            if not self._drop_replica(failed):
                return failed
        return None

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
        with self._log_lock:
            self.log_stream.write(
                f"[pagoda serve] {failed.name} exited with code {failed.process.returncode}: "
                f"replica {failed.replica} retired, {len(replicas) - 1} replica(s) serve on\n")
            self.log_stream.flush()
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
