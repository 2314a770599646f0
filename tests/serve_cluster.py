"""The one way tests start a served cluster: `pagoda serve` as a subprocess, as a user would.

Every cluster test (e2e, api, observability, distributed, routing) imports this module
(`tests/` is on `sys.path` through the root conftest). `ServeProcess` starts the real
command line, waits for the URL it prints, keeps everything it logs, finds the services
it started, scrapes the gateway's /metrics, and stops it with SIGTERM like Ctrl-C.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2 as spb
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2_grpc as spb_grpc
from pagoda.free_ports import free_port

URL_RE = re.compile(r"Pagoda is serving .* at (https?://\S+/v1)")
CLI_MODULE = "pagoda.services.cli.main"


def wait_until(predicate, timeout: float, interval: float = 0.05):
    """The first truthy value of `predicate()` within `timeout` seconds, else its last."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def scheduler_load(address: str, timeout: float = 10.0) -> spb.GetLoadResponse:
    """The load of the scheduler at `address` (host:port), over a channel of its own."""
    with grpc.insecure_channel(address) as channel:
        return spb_grpc.SchedulerServiceStub(channel).GetLoad(spb.GetLoadRequest(),
                                                              timeout=timeout)


class ServeProcess:
    """A running `pagoda serve ARGS --port P`.

    Invariant once constructed: the gateway answers at `url` (`base` + "/v1"); `log` holds
    every line printed so far (stdout and stderr), `stderr_text()` the stderr part."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None,
                 timeout: float = 240.0) -> None:
        try:
            self._start(args, env, timeout)
        except RuntimeError as exc:
            # `pagoda serve` picks free loopback ports, then its services bind them: another
            # process can take one in between. That start-up race is the harness's, not the
            # code under test's: start once more on fresh ports.
            if "Address already in use" not in str(exc):
                raise
            self._start(args, env, timeout)

    def _start(self, args: list[str], env: dict[str, str] | None, timeout: float) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", CLI_MODULE, "serve", *args, "--port", str(self.port)]
        self.process = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.log: list[str] = []
        self._stderr: list[str] = []
        self._url: list[str] = []
        self._up = threading.Event()  # set once it serves, or once its stdout closed
        threading.Thread(target=self._read, args=(self.process.stdout, True), daemon=True).start()
        threading.Thread(target=self._read, args=(self.process.stderr, False), daemon=True).start()
        self._up.wait(timeout)
        if not self._url:
            self.stop()
            time.sleep(0.5)  # let the readers catch the last lines
            raise RuntimeError("pagoda serve did not come up:\n" + "".join(self.log[-60:]))
        self.url = self._url[0]

    def _read(self, stream, is_stdout: bool) -> None:
        for line in stream:
            self.log.append(line)
            if not is_stdout:
                self._stderr.append(line)
            elif not self._url and (match := URL_RE.search(line)):
                self._url.append(match.group(1))
                self._up.set()
        if is_stdout:
            self._up.set()  # exited without serving: stop waiting

    def stderr_text(self) -> str:
        return "".join(self._stderr)

    def service_pid(self, name: str) -> int:
        """The pid of the child running `pagoda.services.cli.main <name>` (the outermost
        one: a gateway's API servers, `--api-server-count`, run its command line too)."""
        matches = {}
        for child in psutil.Process(self.process.pid).children(recursive=True):
            try:
                cmdline, parent = child.cmdline(), child.ppid()
            except psutil.Error:
                continue
            if CLI_MODULE in cmdline and cmdline[cmdline.index(CLI_MODULE) + 1] == name:
                matches[child.pid] = parent
        for pid, parent in matches.items():
            if parent not in matches:
                return pid
        raise LookupError(name)

    def api_server_pids(self) -> list[int]:
        """The gateway's API-server processes under `--api-server-count N` > 1 (the
        children of its parent, which holds the port); [] with one process. Their
        indexes: `--api-server-pid-file`, or the `api server K of N: pid P` log lines."""
        return [c.pid for c in psutil.Process(self.service_pid("gateway")).children()]

    def service_args(self, name: str) -> list[str]:
        return psutil.Process(self.service_pid(name)).cmdline()

    def scheduler_address(self) -> str:
        """host:port of the (first) scheduler's gRPC server."""
        return f"127.0.0.1:{flag_value(self.service_args('scheduler'), '--port')}"

    def scrape(self) -> dict[tuple[str, frozenset], float]:
        """The gateway's /metrics (the whole cluster's) as {(sample, labels): value}."""
        text = httpx.get(f"{self.base}/metrics", timeout=10).text
        return {(s.name, frozenset(s.labels.items())): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def stop(self, timeout: float = 90.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()
