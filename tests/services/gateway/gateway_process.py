"""A real `pagoda gateway` process on loopback, for tests that need its own event loop,
signals or log (the in-thread harness shares the test's process)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx

from pagoda.free_ports import free_port


def start_gateway_process(tokenizer_addr: str, scheduler_addr: str, *args: str,
                          env: dict[str, str] | None = None,
                          timeout: float = 60) -> tuple[subprocess.Popen, str]:
    """(process, base URL) once its /health answers 200; stderr is piped (text), stdout
    dropped. Raises AssertionError when it exits or is not up within `timeout` s; the
    caller stops it."""
    port = free_port()
    gateway = subprocess.Popen(
        [sys.executable, "-m", "pagoda.services.cli.main", "gateway", "--port", str(port),
         "--tokenizer-addr", tokenizer_addr, "--scheduler-addrs", scheduler_addr,
         "--kv-cache-manager-addr", "", *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while not _healthy(url):
        if gateway.poll() is not None or time.monotonic() > deadline:
            gateway.kill()
            raise AssertionError(f"gateway not up: {gateway.stderr.read()[-2000:]}")
        time.sleep(0.1)
    return gateway, url


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
