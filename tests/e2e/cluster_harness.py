"""Start `pagoda serve` as a subprocess, as a user would, and find its services."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil

from pagoda.services.common.redis_server import free_port

URL_RE = re.compile(r"at (http://\S+/v1)")


class ServeProcess:
    """A running `pagoda serve`; `stderr_text()` is everything it logged so far."""

    def __init__(self, args: list[str], timeout: float = 240.0) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "pagoda.services.cli.main", "serve", *args, "--port", str(self.port)]
        self.process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self._stderr: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()
        self.url = self._wait_for_url(timeout)

    def _drain(self) -> None:
        for line in self.process.stderr:
            self._stderr.append(line)

    def stderr_text(self) -> str:
        return "".join(self._stderr)

    def _wait_for_url(self, timeout: float) -> str:
        result: list[str] = []

        def read() -> None:
            for line in self.process.stdout:
                match = URL_RE.search(line)
                if match:
                    result.append(match.group(1))
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout)
        if not result:
            self.stop()
            raise RuntimeError(f"pagoda serve did not come up:\n{self.stderr_text()[-4000:]}")
        return result[0]

    def service_pid(self, name: str) -> int:
        """The pid of the child running `pagoda.services.cli.main <name>`."""
        for child in psutil.Process(self.process.pid).children(recursive=True):
            try:
                cmdline = child.cmdline()
            except psutil.Error:
                continue
            if "pagoda.services.cli.main" in cmdline and cmdline[cmdline.index("pagoda.services.cli.main") + 1] == name:
                return child.pid
        raise LookupError(name)

    def service_args(self, name: str) -> list[str]:
        return psutil.Process(self.service_pid(name)).cmdline()

    def stop(self, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


def flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
